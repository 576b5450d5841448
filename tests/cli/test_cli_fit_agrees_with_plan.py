"""``--fit`` prints, for every candidate, the peak and activations that
``plan`` with the candidate's own options traces: at a shard count it
derives from two others, under HSDP with TP and offload, with one shard per
replica, and with checkpointing, on a model whose blocks mix dtypes and
whose depth is extrapolated from traces at fewer blocks."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli._main import main

MODEL = ("--preset", "mixed", "--layers", "4", "--seq", "128")

CANDIDATES = {
    "shard count derived from 2 and 4": ["--mesh", "dp_shard=8"],
    "HSDP + TP + offload": ["--mesh", "dp_replicate=2,dp_shard=2,tp=2", "--sp", "--offload"],
    "one shard per replica": ["--mesh", "dp_replicate=4,dp_shard=1,tp=2", "--sp", "--ac", "full"],
    "HSDP with checkpointing": ["--mesh", "dp_replicate=2,dp_shard=4", "--ac", "selective"],
}


def _json(argv: list[str]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def by_argv() -> dict[tuple[str, ...], dict[str, Any]]:
    fit = _json(["plan", *MODEL, "--fit", "8x80GiB", "--json"])["fit"]
    return {tuple(c["argv"]): c for c in fit["fitting"] + fit["not_fitting"]}


@pytest.mark.parametrize("name", list(CANDIDATES))
def test_a_candidates_peak_is_what_plan_traces_with_its_options(
    by_argv: dict[tuple[str, ...], dict[str, Any]], name: str
) -> None:
    argv = CANDIDATES[name]
    candidate = by_argv[tuple(argv)]
    memory = _json(["plan", *MODEL, *argv, "--json"])["memory"]
    assert candidate["peak_bytes"] == memory["peak_bytes"]
    assert candidate["activations_bytes"] == memory["activations_bytes"]
