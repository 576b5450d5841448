"""Under ``--ep`` a ``--fit`` candidate's FSDP traffic is what the traced
steps of ``plan`` move: each rank gathers (and reduce-scatters) the dense
units over the shard ranks and its ``1/ep`` of the experts over the MoE
mesh's ``ep_shard`` ranks, not the whole experts."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli._main import main

MIXTRAL = (
    "--hf", "mixtral", "--hf-config",
    "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
    "vocab_size=128,num_local_experts=4,num_experts_per_tok=2",
    "--seq", "64",
)


def _json(*argv: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", *MIXTRAL, *argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def _ring(nbytes: float, n: int) -> float:
    return nbytes * (n - 1) / n


@pytest.fixture(scope="module")
def fitted() -> dict[tuple[str, ...], dict[str, int]]:
    fit = _json("--ep", "1,2", "--fit", "4x1GiB", "--fit-jobs", "1")["fit"]
    return {
        tuple(c["argv"]): c["comm_bytes"]
        for c in fit["fitting"] + fit["not_fitting"]
        if c["activation_checkpointing"] is None and not c["offload"]
    }


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_an_ep_candidate_moves_its_share_of_the_experts_as_the_traced_step_does(
    fitted: dict[tuple[str, ...], dict[str, int]], collective: str
) -> None:
    whole = _json("--mesh", "dp_shard=4", "--batch", "1")["memory"]["collective_bytes"][f"fsdp/{collective}"]
    split = _json("--mesh", "dp_shard=4", "--moe-mesh", "ep_shard=2,ep=2", "--batch", "1")
    traced = split["memory"]["collective_bytes"][f"fsdp/{collective}"]
    # traced (bytes each rank's collectives carry): whole = dense + experts, split = dense + experts / 2
    experts = 2 * (whole - traced)
    dense = traced - experts / 2
    assert experts > 0 and dense > 0
    ep1 = fitted[("--mesh", "dp_shard=4")][f"fsdp_{collective}"]
    ep2 = fitted[("--mesh", "dp_shard=4", "--moe-mesh", "ep_shard=2,ep=2")][f"fsdp_{collective}"]
    assert ep1 == pytest.approx(_ring(whole, 4), abs=2)
    assert ep2 == pytest.approx(_ring(dense, 4) + _ring(experts / 2, 2), abs=2)
    assert ep2 < ep1
