"""The ``fsdptx_plan_snapshot`` fixture, exercised on a throwaway test suite
through pytest's ``pytester``: a plan that changes fails with the readable
diff, and ``--fsdptx-update-snapshots`` accepts the change."""

from __future__ import annotations

import json

import pytest

# pytester's in-process runs drop every module first imported inside a run.
# The plugin imports neither torch nor fsdptx's names until a fixture is
# used, so they are imported here, before any run: torch cannot be imported
# twice in one process, and a second run must see the classes of the first.
import fsdptx

fsdptx.Plan  # noqa: B018  (loads the contract, and with it torch)

pytest_plugins = ["pytester"]

SUITE = """
import functools

import torch

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig


def test_the_plan_is_reviewed(fsdptx_plan_snapshot):
    with torch.device("meta"):
        model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=3, fp32_holders=True))
    checkpoint = functools.partial(fsdptx.checkpoint_activations, mode={mode!r})
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, checkpoint, fsdptx.mark_reduction)
    fsdptx_plan_snapshot(fsdptx.plan(model, pipeline), "decoder")
"""


def write_suite(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makepyfile(test_suite=SUITE.format(mode=mode))


def test_a_missing_snapshot_fails_and_says_how_to_write_it(pytester: pytest.Pytester) -> None:
    write_suite(pytester, "full")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no plan snapshot*--fsdptx-update-snapshots*"])


def test_a_changed_plan_fails_with_the_diff_until_the_snapshot_is_updated(pytester: pytest.Pytester) -> None:
    write_suite(pytester, "full")
    pytester.runpytest("--fsdptx-update-snapshots").assert_outcomes(passed=1)
    stored = pytester.path / "__plan_snapshots__" / "decoder.json"
    assert json.loads(stored.read_text())["schema"] == 1
    pytester.runpytest().assert_outcomes(passed=1)

    write_suite(pytester, "selective")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*the plan differs from its snapshot*decoder.json*", "layers.{0..2}: checkpoint full -> selective"]
    )

    pytester.runpytest("--fsdptx-update-snapshots").assert_outcomes(passed=1)
    pytester.runpytest().assert_outcomes(passed=1)
    assert json.loads(stored.read_text())["plan"]["checkpointing"]["mode"] == "selective"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (bytes(range(256)), "utf-8"),
        (b'{"schema": 1, "plan": {"__type__": "Plan", "units": [{"__type__": "Unit"}]', "not JSON"),
        (b'{"schema": 1, "plan": {"__type__": "Plan", "units": [{"__type__": "Unit", "kind": "bogus"}]}}', "a Unit needs"),
    ],
    ids=["binary", "truncated", "tampered"],
)
def test_a_damaged_snapshot_fails_naming_the_file_and_how_to_rewrite_it(
    pytester: pytest.Pytester, content: bytes, reason: str
) -> None:
    write_suite(pytester, "full")
    stored = pytester.path / "__plan_snapshots__" / "decoder.json"
    stored.parent.mkdir()
    stored.write_bytes(content)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"*the plan snapshot *decoder.json cannot be read:*{reason}*", "*run pytest --fsdptx-update-snapshots*"]
    )
    result.stdout.no_fnmatch_line("*Traceback*")
    pytester.runpytest("--fsdptx-update-snapshots").assert_outcomes(passed=1)
    pytester.runpytest().assert_outcomes(passed=1)
    assert json.loads(stored.read_text())["schema"] == 1


STYLE_SUITE = """
import functools

import torch
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

import fsdptx


def test_the_tp_plan_is_reviewed(fsdptx_plan_snapshot):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    transform = functools.partial(fsdptx.tensor_parallel, plan={{"1": RowwiseParallel({options})}})
    fsdptx_plan_snapshot(fsdptx.plan(model, transform), "rowwise")
"""


def test_a_style_setting_the_readable_name_leaves_out_still_fails_the_snapshot(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=STYLE_SUITE.format(options=""))
    pytester.runpytest("--fsdptx-update-snapshots").assert_outcomes(passed=1)
    pytester.makepyfile(test_suite=STYLE_SUITE.format(options="use_local_output=False"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the plan differs from its snapshot*rowwise.json*", "1: TP style use_local_output True -> False"])
