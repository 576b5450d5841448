"""pytest plugin (entry point ``fsdptx``): fixtures for downstream test suites.

Installing fsdptx makes these fixtures available in any pytest run; torch is
imported only when a fixture is used (neither this module nor the packages
above it import it), so the plugin costs nothing otherwise.

``fsdptx_plan_snapshot(plan, name)`` compares a plan with the JSON file
``__plan_snapshots__/<name>.json`` next to the test module and fails with
the readable :func:`fsdptx.diff_plans`; ``pytest --fsdptx-update-snapshots``
writes the files instead (review them like code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..plan._plan import Plan
    from ._collectives import Collective

SNAPSHOT_DIR = "__plan_snapshots__"
UPDATE_OPTION = "--fsdptx-update-snapshots"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("fsdptx").addoption(
        UPDATE_OPTION,
        action="store_true",
        default=False,
        help=f"rewrite the plan snapshots (<test dir>/{SNAPSHOT_DIR}/<name>.json) instead of comparing",
    )


@pytest.fixture
def fsdptx_fake_mesh() -> Iterator[Callable[..., DeviceMesh]]:
    """A factory ``(shape, names, rank=0) -> DeviceMesh`` on a fake process
    group, torn down after the test (one mesh per test at a time)."""
    from ._mesh import fake_mesh

    with ExitStack() as stack:

        def make(shape: Sequence[int], names: Sequence[str], rank: int = 0) -> DeviceMesh:
            return stack.enter_context(fake_mesh(shape, names, rank))

        yield make


@pytest.fixture
def fsdptx_collectives() -> Iterator[Callable[[], list[Collective]]]:
    """A factory returning a list that records every collective issued from
    then until the end of the test."""
    from ._collectives import record_collectives

    with ExitStack() as stack:

        def start() -> list[Collective]:
            return stack.enter_context(record_collectives())

        yield start


def check_plan_snapshot(plan: Plan, path: Path, update: bool) -> None:
    """Compare ``plan`` with the snapshot at ``path`` (or write it when
    ``update``); fail the test with the diff when they differ.

    Compared as plans, not as text: a file written by another fsdptx
    version in another key order still matches an equal plan."""
    from ..plan._diff import diff_plans
    from ..plan._json import plan_from_json, plan_to_json

    text = plan_to_json(plan) + "\n"
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_bytes() != text.encode():
            path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no plan snapshot {path}; run pytest {UPDATE_OPTION} to write it, then review and commit it")
    try:
        stored = plan_from_json(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8 (a ValueError), not JSON, not a plan
        pytest.fail(
            f"the plan snapshot {path} cannot be read: {e}\n"
            f"If the file is damaged, run pytest {UPDATE_OPTION} to rewrite it from the current plan, "
            "then review the diff and commit it.",
            pytrace=False,
        )
    diff = diff_plans(stored, plan)
    if diff:
        pytest.fail(
            f"the plan differs from its snapshot {path}:\n{diff}\n"
            f"If the change is intended, run pytest {UPDATE_OPTION} and commit the file.",
            pytrace=False,
        )


@pytest.fixture
def fsdptx_plan_snapshot(request: pytest.FixtureRequest) -> Callable[[Plan, str], None]:
    """``check(plan, name)``: the plan must equal the snapshot
    ``<test dir>/__plan_snapshots__/<name>.json``; the failure shows what
    changed (:func:`fsdptx.diff_plans`). With ``--fsdptx-update-snapshots``
    the snapshot is (re)written instead."""
    update = bool(request.config.getoption(UPDATE_OPTION))
    directory = request.path.parent / SNAPSHOT_DIR

    def check(plan: Plan, name: str) -> None:
        if not name or "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"fsdptx_plan_snapshot: name must be a plain file stem, got {name!r}")
        check_plan_snapshot(plan, directory / f"{name}.json", update)

    return check
