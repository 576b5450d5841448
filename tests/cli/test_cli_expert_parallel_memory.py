"""The traced step under expert parallelism agrees with torch's
FSDPMemTracker run the plain way on the model a training job builds, with
the routing forced balanced (``tests/support/ep_tracker_recipe.py``):
transformers' own all-to-all dispatch and ``grouped_mm`` experts, not the
dry run's static stand-in. Parameters, gradients and optimizer state
within 1%, activations within 15%, the peak within -10%/+15%, as for dense
models (``test_memory_plan.py``) and pipeline stages
(``test_cli_pipeline_memory.py``).

The model is fp32 (master weights) with the default bf16 compute policy:
AdamW's two states are fp32, as torch allocates them for fp32 parameters
(the dry run counts them in each parameter's storage dtype).
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.manager import FSDP2Config

from ep_tracker_recipe import EP_CONFIG, EXPERTS, TOP_K, EpReference, ep_tracker_reference

BATCH, SEQ = 2, 64
HF_CONFIG = ",".join(f"{k}={v}" for k, v in EP_CONFIG.items())

# dense mesh, MoE mesh (the same 4 ranks)
CASES: dict[str, tuple[str, str]] = {
    "dp_shard4-ep_shard2xep2": ("dp_shard=4", "ep_shard=2,ep=2"),
    "hsdp-dp_replicate2xep2": ("dp_replicate=2,dp_shard=2", "dp_replicate=2,ep=2"),
    "dp_shard4-ep4": ("dp_shard=4", "ep_shard=1,ep=4"),
}


def _dims(spec: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes = [(name, int(size)) for name, size in (item.split("=") for item in spec.split(","))]
    return tuple(s for _, s in sizes), tuple(n for n, _ in sizes)


def dry_run(mesh: str, moe_mesh: str) -> dict[str, Any]:
    argv = ["plan", "--hf", "qwen3_moe", "--hf-config", HF_CONFIG, "--dtype", "fp32", "--mesh", mesh]
    argv += ["--moe-mesh", moe_mesh, "--batch", str(BATCH), "--seq", str(SEQ), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()
    memory: dict[str, Any] = json.loads(out.getvalue())["memory"]
    return memory


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any], EpReference, int]:
    mesh, moe_mesh = CASES[request.param]
    (shape, names), (moe_shape, moe_names) = _dims(mesh), _dims(moe_mesh)
    ep = dict(zip(moe_names, moe_shape))["ep"]
    ref = ep_tracker_reference(BATCH, SEQ, shape, names, moe_shape, moe_names, FSDP2Config())
    return dry_run(mesh, moe_mesh), ref, ep


def within(value: int, reference: int, low: float, high: float) -> bool:
    return reference * (1 + low) <= value <= reference * (1 + high)


def test_the_reference_routes_tokens_as_the_dry_run_assumes(case: tuple[dict[str, Any], EpReference, int]) -> None:
    memory, ref, ep = case
    routing = memory["expert_parallel"]
    assert routing["routing"] == "balanced" and routing["ep"] == ep
    mean = ep * BATCH * SEQ * TOP_K // EXPERTS
    assert routing["tokens_per_expert"] == mean
    # transformers' dispatch ran in each experts module (2 layers) in both
    # iterations, and each received what the dry run's rank receives
    assert ref.received_rows == (routing["recv_rows"],) * 4 == (EXPERTS // ep * mean,) * 4


def test_params_grads_and_optimizer_state_under_ep_are_within_one_percent(
    case: tuple[dict[str, Any], EpReference, int],
) -> None:
    memory, ref, _ = case
    for key, expected in (("params_bytes", ref.params), ("grads_bytes", ref.grads), ("optimizer_bytes", ref.optimizer)):
        assert within(memory[key], expected, -0.01, 0.01), (key, memory[key], expected)


def test_activations_under_ep_are_within_fifteen_percent(case: tuple[dict[str, Any], EpReference, int]) -> None:
    memory, ref, _ = case
    assert within(memory["activations_bytes"], ref.activations, -0.15, 0.15), (memory["activations_bytes"], ref.activations)


def test_the_peak_under_ep_is_within_minus_ten_plus_fifteen_percent(case: tuple[dict[str, Any], EpReference, int]) -> None:
    memory, ref, _ = case
    assert within(memory["peak_bytes"], ref.peak, -0.10, 0.15), (memory["peak_bytes"], ref.peak)
