"""The per-rank memory of a pipelined training step, from Python.

:func:`estimate_memory` sizes one rank of a job without stages. A pipelined
job's ranks differ: each holds its own stages' shards, and the schedule
decides how many micro-batches' activations a rank keeps at once (1F1B: up
to ``pp - rank``; GPipe: all). :func:`estimate_pipeline_memory` runs the
same dry run as ``python -m fsdptx plan --mesh pp=...,... --batch B --seq S``
(:func:`fsdptx.cli._pipeline.pipeline_dry_run_on`) on the caller's manager
and returns every pipeline rank's traced step, so a trainer can check
each rank (and find the one that peaks) before it launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core._args import require_module, require_positive_int
from ..core._meshes import ep_size
from ._common import UsageError, _one_line
from ._memory import MemoryEstimate, check_seq_split, check_step_arguments
from ._pipeline import PipelineRun, pipeline_dry_run_on, traced_peak
from ._report import ParamShard
from ._stage_trace import TRACED_SCHEDULES, RankTrace, StageTrace

__all__ = ["PipelineMemoryEstimate", "PipelineRankMemory", "estimate_pipeline_memory"]


@dataclass(frozen=True)
class PipelineRankMemory:
    """One pipeline rank's traced step: all of its stages together.

    Attributes:
        rank: the pipeline rank.
        stages: the stages it runs (one, or ``stages_per_rank`` interleaved).
        memory: its step as :class:`MemoryEstimate` (``batch`` is one
            micro-batch's sequences): parameters, gradients and optimizer
            state of its stages' shards, exact; activations and the peak traced.
        in_flight: the most micro-batches whose activations it holds at once.
        activations_per_microbatch: saved for backward by one micro-batch's forward.
        p2p_buffer_bytes: torch's receive buffers of its stages.
        peak_stage: the stage running when it peaks (``None``: outside any
            stage's forward or backward, in the optimizer step).
        peak_microbatch: the micro-batch running then (``None`` likewise).

    Example::

        for r in fsdptx.estimate_pipeline_memory(manager, model, batch=8, seq=4096).ranks:
            print(r.rank, r.stages, r.in_flight, r.memory.peak_bytes)
    """

    rank: int
    stages: tuple[int, ...]
    memory: MemoryEstimate
    in_flight: int
    activations_per_microbatch: int
    p2p_buffer_bytes: int
    peak_stage: int | None
    peak_microbatch: int | None

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-ready data."""
        return {
            "rank": self.rank,
            "stages": list(self.stages),
            "in_flight_microbatches": self.in_flight,
            "activations_per_microbatch_bytes": self.activations_per_microbatch,
            "p2p_buffer_bytes": self.p2p_buffer_bytes,
            "peak_stage": self.peak_stage,
            "peak_microbatch": self.peak_microbatch,
            "memory": self.memory.to_json(),
        }


@dataclass(frozen=True)
class PipelineMemoryEstimate:
    """What each pipeline rank holds over one training step.

    Attributes:
        schedule: torch's schedule the step was traced under.
        microbatches: micro-batches per step.
        microbatch: sequences per micro-batch.
        seq: tokens per sequence.
        ranks: each pipeline rank's step, in rank order.

    Example::

        estimate = fsdptx.estimate_pipeline_memory(manager, model, batch=8, seq=4096)
        print(estimate.peak.rank, estimate.peak.memory.peak_bytes)
    """

    schedule: str
    microbatches: int
    microbatch: int
    seq: int
    ranks: tuple[PipelineRankMemory, ...]

    @property
    def peak(self) -> PipelineRankMemory:
        """The rank whose step peaks highest (the lowest such rank on a tie):
        the one a device's memory has to fit."""
        return max(self.ranks, key=lambda r: (r.memory.peak_bytes, -r.rank))

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-ready data (the timelines are left out)."""
        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "microbatch": self.microbatch,
            "seq": self.seq,
            "peak_rank": self.peak.rank,
            "ranks": [r.to_json() for r in self.ranks],
        }


def estimate_pipeline_memory(
    manager: Any,
    model: nn.Module,
    *,
    batch: int | None = None,
    seq: int = 2048,
    optimizer: str = "adamw",
    cp_rotate: str = "allgather",
) -> PipelineMemoryEstimate:
    """Each pipeline rank's memory over one training step of ``model`` under ``manager``.

    ``manager`` carries ``FSDP2Config(pipeline_parallel=...)`` on a fake
    mesh with a ``pp`` dim (:func:`fsdptx.testing.fake_mesh`). Every stage
    is built and parallelized as :func:`fsdptx.apply_pipeline` does on the
    ranks that run it, then each pipeline rank's step is traced under
    ``FakeTensorMode``: its micro-batches in the schedule's order (1F1B,
    GPipe, Interleaved1F1B), the activations of those in flight, torch's
    P2P receive buffers and the optimizer step. Nothing is allocated;
    ``model`` is consumed (its tensors become fake) once every check has
    passed, and they all come first: a refused call leaves ``model`` as it
    was. For a job without stages use :func:`estimate_memory`.

    Args:
        manager: the :class:`fsdptx.FSDP2Manager` whose pipeline to size.
        model: the whole model on the meta device.
        batch: sequences per data-parallel rank per step, split evenly
            into the schedule's micro-batches; ``None``: one sequence per
            micro-batch.
        seq: tokens per sequence.
        optimizer: ``adamw`` (2 states in the parameters' storage dtype), ``sgd`` (1) or ``none``.
        cp_rotate: with a ``cp`` dim > 1, how ring attention rotates K/V
            (``allgather`` or ``alltoall``): each stage is traced at
            ``seq / cp`` tokens and the rotation's buffers of its own
            attention layers are modelled, as :func:`estimate_memory` does.

    Returns:
        A :class:`PipelineMemoryEstimate`, one entry per pipeline rank
        (data-parallel and TP coordinate 0).

    Raises:
        TypeError: ``manager`` is not an ``FSDP2Manager``, ``model`` not a
            module or has no token embedding, ``batch`` or ``seq`` not an int.
        ValueError: ``manager`` plans no pipeline or has a ``moe_mesh``
            (experts are not traced inside stages), ``batch`` or ``seq``
            below 1, ``optimizer`` or ``cp_rotate`` unknown, ``model`` not
            on the meta device, ``seq`` not split by the TP size under
            sequence parallelism (or by ``2 x cp`` with ``cp`` > 1),
            ``batch`` not split by the micro-batches, a schedule the dry
            run does not trace or torch refuses, a model that cannot be
            planned into stages, or a mesh larger than the dry run applies.

    Example::

        config = fsdptx.FSDP2Config(pipeline_parallel=fsdptx.PipelineParallelConfig(schedule="1F1B", microbatches=8))
        with fsdptx.testing.fake_mesh((4, 8), ("pp", "dp")) as mesh, torch.device("meta"):
            model = build_model()
            estimate = fsdptx.estimate_pipeline_memory(fsdptx.FSDP2Manager(config, mesh), model, batch=8, seq=4096)
    """
    from ..manager import FSDP2Manager

    where = "estimate_pipeline_memory"
    if not isinstance(manager, FSDP2Manager):
        raise TypeError(f"{where}: manager must be an fsdptx.FSDP2Manager, got {type(manager).__name__}")
    require_module(model, "model", where)
    if batch is not None:
        batch = require_positive_int(batch, "batch", where)
    seq = require_positive_int(seq, "seq", where)
    check_step_arguments(model, optimizer, where)
    check_seq_split(manager, seq, cp_rotate, where)
    if manager.config.pipeline_parallel is None:
        raise ValueError(
            f"{where}: manager plans no pipeline (FSDP2Config(pipeline_parallel=None)); size a job without "
            "stages with fsdptx.estimate_memory"
        )
    if manager.moe_mesh is not None:
        raise ValueError(
            f"{where}: manager has a moe_mesh (ep={ep_size(manager.moe_mesh)}); experts on a MoE mesh are not traced "
            "inside pipeline stages: size them with fsdptx.estimate_memory on a mesh without pp"
        )
    planned = manager.plan(model)  # pure: what the schedule and micro-batches are
    pipeline = planned.pipeline
    assert pipeline is not None  # the config asks for one
    if pipeline.schedule not in TRACED_SCHEDULES:
        raise ValueError(
            f"{where}: traces the schedules {', '.join(TRACED_SCHEDULES)}, not {pipeline.schedule}; "
            "FSDP2Manager.plan gives every stage's exact parameters, and `python -m fsdptx plan` with a pp axis "
            "and without --batch/--seq their shape-only memory"
        )
    if batch is not None and batch % pipeline.microbatches:
        m = pipeline.microbatches
        raise ValueError(
            f"{where}: batch={batch} does not split into {m} micro-batches; give a multiple of {m} "
            f"({m}, {2 * m}, {4 * m}, ...) or other microbatches in PipelineParallelConfig"
        )
    try:
        run = pipeline_dry_run_on(
            manager, model, batch_seq=(batch or 1, seq), batch_given=batch is not None, cp_rotate=cp_rotate, planned=planned
        )
    except UsageError as e:  # the dry run's refusals name what to change; here they are bad arguments
        raise ValueError(f"{where}: {_one_line(e)}") from None
    return _estimate(run, optimizer)


def _estimate(run: PipelineRun, optimizer: str) -> PipelineMemoryEstimate:
    """The traced ``run`` as one entry per pipeline rank."""
    pipeline = run.pipeline
    assert run.micro_batch is not None  # traced: the call gave batch_seq
    by_rank = {t.rank: t for t in run.ranks}
    ranks = []
    for r in range(pipeline.size):
        mine = [sr for sr in run.stages if sr.stage.rank == r]
        shards: dict[str, ParamShard] = {fqn: sh for sr in mine for fqn, sh in sr.shards.items()}
        trace: StageTrace | RankTrace | None = by_rank[r] if r in by_rank else mine[0].trace
        assert trace is not None  # one stage per rank carries its trace; several share the rank's
        memory, position = traced_peak(trace, shards, run.micro_batch, optimizer)
        ranks.append(_rank(r, tuple(sr.stage.index for sr in mine), trace, memory, position))
    micro, seq = run.micro_batch
    return PipelineMemoryEstimate(pipeline.schedule, pipeline.microbatches, micro, seq, tuple(ranks))


def _rank(r: int, stages: Sequence[int], trace: StageTrace | RankTrace, memory: MemoryEstimate, position: int) -> PipelineRankMemory:
    if isinstance(trace, RankTrace):
        action = trace.action_at(position)
        stage, microbatch = (None, None) if action is None else (action[1], action[2])
    else:
        microbatch = trace.microbatch_at(position)
        stage = None if microbatch is None else stages[0]
    return PipelineRankMemory(
        rank=r,
        stages=tuple(stages),
        memory=memory,
        in_flight=trace.in_flight,
        activations_per_microbatch=trace.activations_per_microbatch,
        p2p_buffer_bytes=trace.p2p_buffer_bytes,
        peak_stage=stage,
        peak_microbatch=microbatch,
    )
