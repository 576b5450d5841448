"""``fsdptx.estimate_pipeline_memory``: each pipeline rank's traced step from
Python, the same figures ``python -m fsdptx plan --mesh pp=...`` prints
(whose accuracy against torch's FSDPMemTracker ``test_cli_pipeline_memory.py``
and ``test_cli_pipeline_interleaved_trace.py`` hold), and every refusal
before the model is touched."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.cli._main import main
from fsdptx.manager import FSDP2Config, FSDP2Manager, PipelineParallelConfig
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of

SEQ = 128


def _llama(layers: int = 2) -> nn.Module:
    with torch.device("meta"):
        return build_preset("llama", layers)


def _config(schedule: str = "1F1B", microbatches: int | None = 4, stages_per_rank: int = 1, sp: bool = False) -> FSDP2Config:
    pipe = PipelineParallelConfig(schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank)
    return FSDP2Config(sequence_parallel=sp, pipeline_parallel=pipe)


def _cli(layers: int, mesh: str, schedule: str, stages_per_rank: int, sp: bool) -> dict[str, Any]:
    argv = ["plan", "--preset", "llama", "--layers", str(layers), "--mesh", mesh, "--schedule", schedule]
    argv += ["--microbatches", "4", "--stages-per-rank", str(stages_per_rank), "--batch", "4", "--seq", str(SEQ), "--json"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv + (["--sp"] if sp else [])) == 0, err.getvalue()
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def _estimate(layers: int, mesh: str, schedule: str, stages_per_rank: int, sp: bool) -> fsdptx.PipelineMemoryEstimate:
    sizes = [item.split("=") for item in mesh.split(",")]
    model = _llama(layers)
    with fake_mesh(tuple(int(s) for _, s in sizes), tuple(n for n, _ in sizes)) as device_mesh:
        manager = FSDP2Manager(_config(schedule, 4, stages_per_rank, sp), device_mesh)
        return fsdptx.estimate_pipeline_memory(manager, model, batch=4, seq=SEQ)


# (layers, mesh, schedule, stages per rank, --sp)
JOBS: dict[str, tuple[int, str, str, int, bool]] = {
    "pp2xdp2-1F1B": (2, "pp=2,dp=2", "1F1B", 1, False),
    "pp2xdp2-GPipe": (2, "pp=2,dp=2", "GPipe", 1, False),
    "pp2xdp2xtp2-sp-1F1B": (2, "pp=2,dp=2,tp=2", "1F1B", 1, True),
    "pp2xdp2-Interleaved1F1B": (4, "pp=2,dp=2", "Interleaved1F1B", 2, False),
}

FIGURES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes")


@pytest.mark.parametrize("job", list(JOBS))
def test_each_rank_holds_what_the_command_lines_dry_run_traces_to_the_byte(job: str) -> None:
    estimate, data = _estimate(*JOBS[job]), _cli(*JOBS[job])
    assert [r.rank for r in estimate.ranks] == [r["rank"] for r in data["ranks"]] == [0, 1]
    for mine, theirs in zip(estimate.ranks, data["ranks"]):
        assert list(mine.stages) == theirs["stages"]
        if len(mine.stages) > 1:  # several stages traced together: the rank's own step
            traced = theirs["memory"]["traced"]
        else:
            (traced,) = [s["memory"] for s in data["stages"] if s["index"] == mine.stages[0]]
        assert {k: getattr(mine.memory, k) for k in FIGURES} == {k: traced[k] for k in FIGURES}
        assert mine.in_flight == traced["in_flight_microbatches"]
        assert mine.p2p_buffer_bytes == traced["p2p_buffer_bytes"]
        assert mine.activations_per_microbatch == traced["activations_per_microbatch_bytes"]
    assert estimate.peak.rank == data["memory"]["pp_rank"]
    assert estimate.peak.memory.peak_bytes == data["memory"]["peak_bytes"]


def test_1f1b_ranks_hold_fewer_micro_batches_down_the_pipeline_and_gpipe_holds_all() -> None:
    one_f_one_b = _estimate(*JOBS["pp2xdp2-1F1B"])
    gpipe = _estimate(*JOBS["pp2xdp2-GPipe"])
    assert [r.in_flight for r in one_f_one_b.ranks] == [2, 1]  # pp - rank
    assert [r.in_flight for r in gpipe.ranks] == [4, 4]
    for a, b in zip(one_f_one_b.ranks, gpipe.ranks):
        assert a.memory.activations_bytes < b.memory.activations_bytes
        assert a.memory.params_bytes == b.memory.params_bytes


def test_the_peak_is_the_first_rank_that_peaks_highest_and_names_a_stage_of_that_rank() -> None:
    estimate = _estimate(*JOBS["pp2xdp2-Interleaved1F1B"])
    highest = max(r.memory.peak_bytes for r in estimate.ranks)
    assert estimate.peak.rank == min(r.rank for r in estimate.ranks if r.memory.peak_bytes == highest)
    for r in estimate.ranks:
        assert r.peak_stage is None or r.peak_stage in r.stages
    tied = dataclasses.replace(estimate, ranks=(estimate.ranks[1], dataclasses.replace(estimate.ranks[0], rank=2, memory=estimate.ranks[1].memory)))
    assert tied.peak.rank == 1


def test_without_a_batch_each_micro_batch_is_one_sequence() -> None:
    model = _llama()
    with fake_mesh((2, 1), ("pp", "dp")) as mesh:
        estimate = fsdptx.estimate_pipeline_memory(FSDP2Manager(_config(microbatches=3), mesh), model, seq=32)
    assert (estimate.microbatches, estimate.microbatch, estimate.seq) == (3, 1, 32)
    assert all(r.memory.batch == 1 and r.memory.seq == 32 for r in estimate.ranks)


def test_the_estimate_is_json_ready_and_names_the_peak_rank() -> None:
    estimate = _estimate(*JOBS["pp2xdp2-1F1B"])
    data = json.loads(json.dumps(estimate.to_json()))
    assert data["schedule"] == "1F1B" and data["microbatches"] == 4 and data["microbatch"] == 1
    assert data["peak_rank"] == estimate.peak.rank
    assert [r["memory"]["peak_bytes"] for r in data["ranks"]] == [r.memory.peak_bytes for r in estimate.ranks]


# --------------------------------------------------------------------------- refusals


def _moe_manager(mesh: Any) -> FSDP2Manager:
    moe = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "ep_shard", "ep"))
    return FSDP2Manager(_config(), mesh, moe)


# name -> (mesh shape, names, manager from mesh, model, keyword arguments, error, message)
REFUSALS: dict[str, tuple[tuple[int, ...], tuple[str, ...], Callable[[Any], Any], Callable[[], nn.Module], dict[str, Any], type[Exception], str]] = {
    "a manager without stages": (
        (2,), ("dp",), lambda m: FSDP2Manager(FSDP2Config(), m), _llama, {},
        ValueError, r"estimate_pipeline_memory: manager plans no pipeline .*fsdptx.estimate_memory",
    ),
    "not a manager": (
        (2, 1), ("pp", "dp"), lambda m: _config(), _llama, {},
        TypeError, "estimate_pipeline_memory: manager must be an fsdptx.FSDP2Manager, got FSDP2Config",
    ),
    "a moe mesh": (
        (2, 2), ("pp", "dp"), _moe_manager, _llama, {},
        ValueError, "estimate_pipeline_memory: manager has a moe_mesh .ep=2.; experts on a MoE mesh are not traced",
    ),
    "a batch the micro-batches do not split": (
        (2, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config(microbatches=2), m), _llama, {"batch": 3},
        ValueError, r"estimate_pipeline_memory: batch=3 does not split into 2 micro-batches; give a multiple of 2",
    ),
    "a schedule the dry run does not trace": (
        (2, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config("LoopedBFS", 2, stages_per_rank=2), m), lambda: _llama(4), {},
        ValueError, "estimate_pipeline_memory: traces the schedules 1F1B, GPipe, Interleaved1F1B, not LoopedBFS",
    ),
    "1F1B with fewer micro-batches than stages": (
        (4, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config(microbatches=2), m), lambda: _llama(4), {},
        ValueError, "schedule '1F1B' needs at least one micro-batch per stage, got microbatches=2 for 4 stages",
    ),
    "a sequence the TP ranks do not split under SP": (
        (2, 1, 2), ("pp", "dp", "tp"), lambda m: FSDP2Manager(_config(sp=True), m), _llama, {"seq": 63},
        ValueError, "estimate_pipeline_memory: seq=63 is not divisible by the tensor-parallel size 2",
    ),
    "an unknown optimizer": (
        (2, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config(), m), _llama, {"optimizer": "lion"},
        ValueError, "estimate_pipeline_memory: optimizer must be one of adamw, sgd, none, got 'lion'",
    ),
    "a batch as a string": (
        (2, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config(), m), _llama, {"batch": "4"},
        TypeError, "estimate_pipeline_memory: batch must be a positive int, got '4'",
    ),
    "a model on the CPU": (
        (2, 1), ("pp", "dp"), lambda m: FSDP2Manager(_config(), m), lambda: build_preset("llama", 2), {},
        ValueError, "estimate_pipeline_memory needs a model built on the meta device",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_refused_call_leaves_the_model_as_it_was(name: str) -> None:
    shape, names, manager_of, build, kwargs, error, message = REFUSALS[name]
    model = build()
    before = state_of(model)
    with fake_mesh(shape, names) as mesh, pytest.raises(error, match=message):
        fsdptx.estimate_pipeline_memory(manager_of(mesh), model, **{"batch": 4, "seq": 64, **kwargs})
    assert_unchanged(before, state_of(model))


def test_estimate_memory_sends_a_pipelined_manager_to_estimate_pipeline_memory() -> None:
    model = _llama()
    before = state_of(model)
    with fake_mesh((2, 2), ("pp", "dp")) as mesh, pytest.raises(
        ValueError, match=r"estimate_memory: manager plans pipeline stages .*fsdptx.estimate_pipeline_memory"
    ):
        fsdptx.estimate_memory(FSDP2Manager(_config(), mesh), model, batch=4, seq=64)
    assert_unchanged(before, state_of(model))
