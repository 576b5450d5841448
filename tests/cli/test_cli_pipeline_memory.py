"""The traced step of each pipeline stage agrees with torch's FSDPMemTracker
run the plain way on the stage a training job builds
(``tests/support/stage_tracker_recipe.py``): parameters, gradients and
optimizer state within 1%, activations within 15%, the peak within
-10%/+15%, as for a whole model (``test_memory_plan.py``)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.manager import FSDP2Config, PipelineParallelConfig

from stage_tracker_recipe import StageReference, stage_tracker_reference

SEQ = 128
LAYERS = 2
DIM = 1024  # the llama preset's width

# (mesh, --sp, schedule, order of stage 0's and stage 1's micro-batches as torch runs them, received shape)
CASES: dict[str, tuple[str, bool, str, tuple[str, str], tuple[int, ...]]] = {
    "pp2xdp2-1F1B": ("pp=2,dp=2", False, "1F1B", ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"), (1, SEQ, DIM)),
    "pp2xdp2-GPipe": ("pp=2,dp=2", False, "GPipe", ("F0 F1 F2 F3 B0 B1 B2 B3",) * 2, (1, SEQ, DIM)),
    "pp2xdp2xtp2-sp-1F1B": (
        "pp=2,dp=2,tp=2",
        True,
        "1F1B",
        ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"),
        (1, SEQ // 2, DIM),
    ),
}


def dry_run(mesh: str, sp: bool, schedule: str) -> dict[str, Any]:
    argv = ["plan", "--preset", "llama", "--layers", str(LAYERS), "--mesh", mesh, "--schedule", schedule]
    argv += ["--microbatches", "4", "--batch", "4", "--seq", str(SEQ), "--json"] + (["--sp"] if sp else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    assert code == 0, err.getvalue()
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[StageReference]]:
    mesh, sp, schedule, orders, hidden = CASES[request.param]
    data = dry_run(mesh, sp, schedule)
    sizes = [(name, int(size)) for name, size in (item.split("=") for item in mesh.split(","))]
    shape, names = tuple(s for _, s in sizes), tuple(n for n, _ in sizes)
    config = FSDP2Config(
        sequence_parallel=sp, pipeline_parallel=PipelineParallelConfig(schedule=schedule, microbatches=4)
    )
    refs = [
        stage_tracker_reference(LAYERS, SEQ, shape, names, config, pp_rank=r, order=orders[r], hidden=hidden)
        for r in range(2)
    ]
    return data, refs


def within(value: int, reference: int, low: float, high: float) -> bool:
    return reference * (1 + low) <= value <= reference * (1 + high)


def test_each_stages_params_grads_and_optimizer_state_are_within_one_percent(
    case: tuple[dict[str, Any], list[StageReference]],
) -> None:
    data, refs = case
    for stage, ref in zip(data["stages"], refs):
        m = stage["memory"]
        for key, expected in (("params_bytes", ref.params), ("grads_bytes", ref.grads), ("optimizer_bytes", ref.optimizer)):
            assert within(m[key], expected, -0.01, 0.01), (stage["index"], key, m[key], expected)


def test_each_stages_activations_are_within_fifteen_percent(case: tuple[dict[str, Any], list[StageReference]]) -> None:
    data, refs = case
    for stage, ref in zip(data["stages"], refs):
        got = stage["memory"]["activations_bytes"]
        assert within(got, ref.activations, -0.15, 0.15), (stage["index"], got, ref.activations)


def test_each_stages_peak_is_within_minus_ten_plus_fifteen_percent(
    case: tuple[dict[str, Any], list[StageReference]],
) -> None:
    data, refs = case
    for stage, ref in zip(data["stages"], refs):
        got = stage["memory"]["peak_bytes"]
        assert within(got, ref.peak, -0.10, 0.15), (stage["index"], got, ref.peak)


@pytest.mark.parametrize(("shape", "names"), [((2, 2), ("pp", "dp")), ((2, 2, 2), ("pp", "dp", "tp"))])
def test_the_shape_only_gathered_and_accumulated_gradients_are_what_the_traced_step_holds_when_it_reduces(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    import torch

    from fsdptx.cli._pipeline import pipeline_dry_run
    from fsdptx.cli._report import memory_plan
    from fsdptx.presets import build_preset

    with torch.device("meta"):
        model = build_preset("llama", LAYERS)
    config = FSDP2Config(sequence_parallel="tp" in names, pipeline_parallel=PipelineParallelConfig(microbatches=2))
    run = pipeline_dry_run(model, shape, names, config, batch_seq=(2, SEQ))
    for stage in run.stages:
        assert stage.trace is not None
        mem = memory_plan(stage.stage.plan, stage.shards, dp_shard=run.dims.dp_shard, tp=run.dims.tp)
        gathered = sum(u.gathered for u in mem.units)
        accumulated = sum(u.reduce_input for u in mem.units)
        reducing = next(s for s in stage.trace.trace.samples if s.phase == "reduce_grad")
        # what is left before the reduction: every unit gathered, its unsharded
        # gradients accumulated, the received inputs' gradients
        extra = 0
        if "tp" in names and stage.stage.index == 0:
            # torch's DTensor gives the vocabulary-sharded embedding's gradient
            # as a Replicate tensor: twice its TP-local fp32 size
            extra = 32000 // 2 * DIM * 4
        assert reducing.bytes["gathered_params"] == gathered
        assert reducing.bytes["temporaries"] == accumulated + stage.trace.input_grad_bytes + extra
