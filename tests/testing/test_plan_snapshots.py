"""The ``fsdptx_plan_snapshot`` fixture, exercised on a throwaway test suite
through pytest's ``pytester``: a plan that changes fails with the readable
diff, and ``--fsdptx-update-snapshots`` accepts the change."""

from __future__ import annotations

import json

import pytest

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
