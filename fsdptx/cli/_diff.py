"""``python -m fsdptx diff A.json B.json``: what changed between two plans.

Either file may be a bare :func:`fsdptx.plan_to_json` document or a
``python -m fsdptx plan --json`` report (which carries the plan under
``"plan"``). Exit status 0 when the plans are equal, 1 when they differ, so
a CI step can fail on an unreviewed plan change; 2 for an unreadable file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..plan._diff import diff_plans
from ..plan._json import plan_from_document
from ..plan._plan import Plan

__all__ = ["add_diff_parser", "run_diff"]


class PlanFileError(Exception):
    """A plan file that cannot be read: the message names the file."""


def add_diff_parser(sub: Any) -> None:
    """Register the ``diff`` subcommand on ``sub`` (argparse subparsers)."""
    d = sub.add_parser("diff", help="compare two plan files (plan_to_json, or plan --json reports)")
    d.add_argument("a", help="the plan before (JSON)")
    d.add_argument("b", help="the plan after (JSON)")


def load_plan_file(path: str) -> Plan:
    """The plan in ``path``: a plan document, or a report holding one under ``"plan"``."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as e:
        raise PlanFileError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PlanFileError(f"{path} is not a plan file: not UTF-8 text (byte {e.start}); give a JSON plan") from None
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(f"{path} is not JSON: {e}") from None
    except RecursionError:
        raise PlanFileError(f"{path} is not a plan file: its JSON is nested too deeply") from None
    if isinstance(data, dict) and "schema" not in data and isinstance(data.get("plan"), dict):
        data = data["plan"]  # a `plan --json` report embeds the plan document under "plan"
    try:
        return plan_from_document(data)
    except ValueError as e:
        raise PlanFileError(f"{path}: {e}") from None


def run_diff(args: argparse.Namespace) -> tuple[str, int]:
    """The diff text and the exit status (0 equal, 1 different)."""
    diff = diff_plans(load_plan_file(args.a), load_plan_file(args.b))
    if not diff:
        return f"plans are equal: {args.a} and {args.b}", 0
    return f"--- {args.a}\n+++ {args.b}\n{diff}", 1
