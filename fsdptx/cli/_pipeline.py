"""``python -m fsdptx plan --mesh pp=...``: the dry run of a pipelined job.

With a ``pp`` axis in ``--mesh`` the manager plans pipeline stages
(:class:`fsdptx.PipelineParallelConfig` from ``--schedule``,
``--microbatches``, ``--stages-per-rank``, ``--layers-per-stage``), and each
stage is applied with its own Plan on the fake mesh exactly as
:func:`fsdptx.apply_pipeline` applies it on the ranks that run it (TP,
checkpointing, FSDP units over the mesh's other dims). Every stage is
applied here, whichever pipeline rank runs it: a stage's shards depend on
the data-parallel and TP coordinates, not on the pipeline one. torch's
schedule is built for pipeline rank 0's stages, so a schedule torch refuses
(1F1B with fewer micro-batches than stages) is refused here too.

The report is today's per-rank memory plan once per stage, exact to the
byte: parameters, gradients and optimizer state of rank 0's shards of the
stage, and what a pipelined step holds besides: all of the stage's
parameters stay gathered through the step (nothing reshards under
pipelining) and its unsharded gradients accumulate in the reduce dtype
until one reduce-scatter after the last micro-batch. With ``--batch`` /
``--seq`` each stage's step is traced (:mod:`fsdptx.cli._stage_trace`):
its micro-batches in the schedule's order, activations of the micro-batches
in flight, torch's P2P receive buffers, and the stage whose rank peaks
highest is named.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply._apply import apply_plan
from ..core._meshes import ParallelDims
from ..core._sizes import format_bytes
from ..model._index import ModelIndex, PlanningError
from ..model._stages import PipelineParts, build_stage_module
from ..plan._json import plan_document
from ..plan._plan import Pipeline, Plan, Stage
from ..plan._stages import MULTI_STAGE_SCHEDULES, SINGLE_STAGE_SCHEDULES, PipelineParallelConfig, bubble_fraction
from ._fit_dims import FIT_SCHEDULES, INTERLEAVED_STAGES
from ._common import APPLY_BUDGET, UsageError, _one_line, param_shards
from ._cp import attention_projections, no_attention_error, ring_attention, with_ring_buffers
from ._memory import MemoryEstimate, estimate_from_trace
from ._scaling import rescale, steady_bytes, traced_steady
from ._trace import Trace, vocab_size, where_label
from ._report import ParamShard
from ._run import DryRun
from ._stage_trace import TRACED_SCHEDULES, ActivationMeta, RankTrace, StageTrace, trace_rank, trace_stage

__all__ = [
    "PipelineRun",
    "add_pipeline_arguments",
    "fit_schedules",
    "pipeline_config",
    "pipeline_dry_run",
    "pipeline_dry_run_on",
    "run_pipeline_plan",
    "traced_peak",
]

Report = Callable[[str, Sequence[int], Sequence[str], DryRun, str], dict[str, Any]]
"""The CLI's report of one Plan (:func:`fsdptx.cli._main.report`), made here once per stage."""

_FLAGS = ("--schedule", "--microbatches", "--stages-per-rank", "--layers-per-stage")


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` options of a mesh with a ``pp`` axis."""
    parser.add_argument(
        "--schedule",
        metavar="NAME",
        help=f"pipeline schedule with a pp axis in --mesh: {', '.join(SINGLE_STAGE_SCHEDULES + MULTI_STAGE_SCHEDULES)} (default 1F1B)",
    )
    parser.add_argument(
        "--microbatches", type=int, metavar="N", help="micro-batches per step with a pp axis (default: one per stage)"
    )
    parser.add_argument(
        "--stages-per-rank", type=int, metavar="N", help="stages each pipeline rank runs (default 1; 2 or more for the interleaved schedules)"
    )
    parser.add_argument(
        "--layers-per-stage", type=int, metavar="N", help="blocks per middle stage (default: as even a split as the blocks allow)"
    )


def _given(args: argparse.Namespace) -> list[str]:
    return [f for f in _FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]


def fit_schedules(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    """The (schedule, stages per rank) pairs ``--fit``'s pipeline candidates
    try: ``--schedule`` alone, else 1F1B and Interleaved1F1B (the two whose
    bubble and memory trade against each other; GPipe holds every
    micro-batch for 1F1B's bubble); interleaved with ``--stages-per-rank``
    stages per rank, default :data:`fsdptx.cli._fit_dims.INTERLEAVED_STAGES`.

    Raises:
        UsageError: a schedule ``--fit`` does not model, or stages per rank
            below 2 or with a schedule of one stage per rank.
    """
    schedule, per_rank = args.schedule, args.stages_per_rank
    if schedule is not None and schedule not in FIT_SCHEDULES:
        raise UsageError(f"--fit models the schedules {', '.join(FIT_SCHEDULES)}, not {schedule!r}")
    if per_rank is not None and (per_rank < 2 or schedule in ("1F1B", "GPipe")):
        raise UsageError(
            f"--stages-per-rank {per_rank} under --fit: the interleaved candidates need 2 or more stages per rank, "
            "and 1F1B and GPipe run one"
        )
    interleaved = ("Interleaved1F1B", INTERLEAVED_STAGES if per_rank is None else per_rank)
    if schedule is None:
        return (("1F1B", 1), interleaved)
    return (interleaved,) if schedule == "Interleaved1F1B" else ((schedule, 1),)


def pipeline_config(args: argparse.Namespace, names: Sequence[str] | None) -> PipelineParallelConfig | None:
    """The pipeline the command line asks for: a config when ``names`` (the
    ``--mesh`` axes; None under ``--fit``, which ignores ``--mesh``) has
    ``pp``, else None; the pipeline options without a ``pp`` axis, or with
    what the pipelined dry run does not do, are refused (:class:`UsageError`)."""
    given = _given(args)
    if names is None:
        searched = [f for f in given if f not in ("--schedule", "--microbatches", "--stages-per-rank")]
        if searched:
            raise UsageError(
                f"{', '.join(searched)} apply to a --mesh with a pp axis; --fit's pipeline candidates split the "
                "blocks evenly (--schedule 1F1B, GPipe or Interleaved1F1B, --stages-per-rank, --microbatches)"
            )
        fit_schedules(args)
        if args.microbatches is not None and args.microbatches < 1:
            raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
        return None
    if "pp" not in names:
        if given:
            raise UsageError(f"{', '.join(given)} apply to a --mesh with a pp axis, e.g. --mesh pp=2,dp=4")
        return None
    if args.moe_mesh is not None:
        raise UsageError(
            "--moe-mesh with a pp axis: the dry run does not place experts on pipeline stages; drop --moe-mesh or the pp axis"
        )
    for flag in ("microbatches", "stages_per_rank", "layers_per_stage"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    try:
        return PipelineParallelConfig(
            schedule=args.schedule or "1F1B",
            microbatches=args.microbatches,
            layers_per_stage=args.layers_per_stage,
            stages_per_rank=1 if args.stages_per_rank is None else args.stages_per_rank,
        )
    except (TypeError, ValueError) as e:  # its own message names the field; say which flag that is
        text = _one_line(e).replace("PipelineParallelConfig.", "--").replace("PipelineParallelConfig: ", "")
        for field in ("schedule", "microbatches", "layers_per_stage", "stages_per_rank"):
            text = text.replace(field, field.replace("_", "-"))
        raise UsageError(text) from None


# --------------------------------------------------------------------------- the dry run


@dataclass(frozen=True)
class StageRun:
    """One stage as the dry run applied it: its rank-0 shards and, with
    ``--batch``/``--seq``, its traced step."""

    stage: Stage
    shards: dict[str, ParamShard]
    trace: StageTrace | None = None


@dataclass(frozen=True)
class PipelineRun:
    """The pipelined dry run: the Plan, the dims, how the stages were
    applied (``"full"``, ``"tp"``, ``"computed"``, ``"none"`` as
    :class:`fsdptx.cli._run.DryRun`), each stage and the micro-batch shape
    traced (None without a trace)."""

    plan: Plan
    dims: ParallelDims
    applied: str
    params: int
    stages: tuple[StageRun, ...]
    micro_batch: tuple[int, int] | None = None
    ranks: tuple[RankTrace, ...] = ()  # traced ranks of several stages each (their stages carry no trace)

    @property
    def pipeline(self) -> Pipeline:
        assert self.plan.pipeline is not None
        return self.plan.pipeline


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss torch's schedule is built with (never run by the dry run)."""
    return nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def _check_schedule(pipeline: Pipeline, modules: Sequence[nn.Module], mesh: DeviceMesh) -> None:
    """Build torch's schedule over pipeline rank 0's stages, as
    :func:`fsdptx.apply_pipeline` does, so what torch refuses is refused now."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    group = mesh["pp"].get_group()
    num = len(pipeline.stages)
    local = [
        PipelineStage(modules[s.index], s.index, num, torch.device("cpu"), group=group) for s in pipeline.stages_of(0)
    ]
    cls = get_schedule_class(pipeline.schedule)
    try:
        if issubclass(cls, PipelineScheduleSingle):
            cls(local[0], n_microbatches=pipeline.microbatches, loss_fn=_loss)
        else:
            cls(local, n_microbatches=pipeline.microbatches, loss_fn=_loss)
    except ValueError as e:
        raise UsageError(f"torch's {pipeline.schedule} schedule refuses this pipeline: {_one_line(e)}") from None


def pipeline_dry_run(
    model: nn.Module,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    config: Any,
    *,
    batch_seq: tuple[int, int] | None = None,
    batch_given: bool = True,
    cp_rotate: str = "allgather",
) -> PipelineRun:
    """:func:`pipeline_dry_run_on` with the manager of ``config`` on a fake
    mesh of ``shape``/``names`` (the command line's dry run)."""
    from ..manager import FSDP2Manager
    from ..testing import fake_mesh

    with fake_mesh(shape, names) as mesh:
        return pipeline_dry_run_on(
            FSDP2Manager(config, mesh), model, batch_seq=batch_seq, batch_given=batch_given, cp_rotate=cp_rotate
        )


def pipeline_dry_run_on(
    manager: Any,
    model: nn.Module,
    *,
    batch_seq: tuple[int, int] | None = None,
    batch_given: bool = True,
    cp_rotate: str = "allgather",
    planned: Plan | None = None,
) -> PipelineRun:
    """Plan ``model`` with ``manager`` (``config.pipeline_parallel`` set, a
    fake mesh with a ``pp`` dim), apply every stage on the mesh within
    :data:`fsdptx.cli._common.APPLY_BUDGET`, read each stage's rank-0
    shards and, with ``batch_seq`` (sequences per data-parallel rank,
    tokens per sequence), trace each stage's step at the micro-batch size;
    without ``batch_given`` one sequence per micro-batch. With a ``cp`` dim
    each stage is traced at ``seq / cp`` tokens and ring attention's
    buffers (``cp_rotate``) are added, as the unpipelined step's are
    (:mod:`fsdptx.cli._cp`); the caller has checked that ``seq`` splits.

    Everything that can refuse (the plan, the micro-batch split, the
    schedule torch would refuse, a mesh too large to trace) does so before
    the first stage is applied, so a refused call leaves ``model`` as it
    was. ``planned``: ``manager.plan(model)`` when the caller has it.
    """
    mesh = manager.device_mesh
    dims = manager.dims
    p = manager.plan(model) if planned is None else planned
    pipeline = p.pipeline
    assert pipeline is not None
    if batch_seq is not None and not batch_given:
        batch_seq = (pipeline.microbatches, batch_seq[1])
    micro = _micro_batch(pipeline, batch_seq)
    index = ModelIndex.build(model)
    parts = PipelineParts.from_split(tuple(f for s in pipeline.stages for f in s.modules), pipeline.container)
    num = len(pipeline.stages)
    modules = [build_stage_module(model, index, parts, s.modules, s.index, num) for s in pipeline.stages]  # pure
    n_params = sum(1 for _ in model.parameters())
    has_units = any(s.plan.units for s in pipeline.stages)
    has_tp = any(s.plan.tensor_parallel for s in pipeline.stages)
    tp_cost = n_params * (dims.tp if dims.tp > 1 else 0)
    fsdp_cost = n_params * (dims.dp_shard if has_units else 0)
    if tp_cost + fsdp_cost <= APPLY_BUDGET:
        applied = "full" if (has_units or has_tp) else "none"
    elif tp_cost <= APPLY_BUDGET:
        applied = "tp" if has_tp else "computed"
    else:
        raise UsageError(
            f"tp={dims.tp} over {n_params:,} parameters is more than the dry run simulates "
            f"({APPLY_BUDGET:,} parameter shards); use a smaller tp"
        )
    if micro is not None:
        _check_traceable(model, applied, dims)
    _check_schedule(pipeline, modules, mesh)
    for stage, module in zip(pipeline.stages, modules):
        if applied in ("full", "none"):
            apply_plan(stage.plan, module, mesh)
        else:
            apply_plan(stage.plan.replace(units=(), prefetch=(), reduce_unused_params=False, expert_parallel=None), module, mesh)
    shards = [
        param_shards(module, s.plan, dims, fsdp_applied=applied == "full") for s, module in zip(pipeline.stages, modules)
    ]
    traces: list[StageTrace | None] = [None] * num
    ranks: tuple[RankTrace, ...] = ()
    if micro is not None:
        if pipeline.stages_per_rank > 1:
            ranks = _trace_ranks(model, pipeline, modules, micro, mesh, dims, cp_rotate)
        else:
            traces = list(_trace_stages(model, pipeline, modules, micro, mesh, dims, cp_rotate))
    stages = tuple(StageRun(s, sh, t) for s, sh, t in zip(pipeline.stages, shards, traces))
    return PipelineRun(plan=p, dims=dims, applied=applied, params=n_params, stages=stages, micro_batch=micro, ranks=ranks)


def _micro_batch(pipeline: Pipeline, batch_seq: tuple[int, int] | None) -> tuple[int, int] | None:
    """One micro-batch's (sequences, tokens), refused before anything is
    applied when the micro-batches do not split ``--batch`` evenly (torch's
    schedule would refuse the batch at the first step)."""
    if batch_seq is None:
        return None
    if pipeline.schedule not in TRACED_SCHEDULES:
        raise UsageError(
            f"--batch/--seq trace the step of the schedules {', '.join(TRACED_SCHEDULES)}, not {pipeline.schedule}; "
            "drop them for the exact shape-only figures of every stage"
        )
    batch, seq = batch_seq
    m = pipeline.microbatches
    if batch % m:
        fits = ", ".join(str(b) for b in (m, 2 * m, 4 * m))
        raise UsageError(
            f"--batch {batch} does not split into {m} micro-batches; give --batch a multiple of {m} ({fits}, ...) "
            "or another --microbatches"
        )
    return batch // m, seq


def _check_traceable(model: nn.Module, applied: str, dims: ParallelDims) -> None:
    if applied != "full":
        raise UsageError(
            "the activation trace needs fully_shard applied, and this mesh is larger than the dry run "
            f"simulates ({APPLY_BUDGET:,} parameter shards); trace a smaller dp_shard: activations per "
            "rank do not depend on it"
        )
    if dims.cp > 1 and not attention_projections(model):
        raise UsageError(no_attention_error(model))


def _untraceable(what: str, e: Exception) -> UsageError:
    return UsageError(
        f"{what}'s step could not be traced under FakeTensorMode ({type(e).__name__}: "
        f"{' '.join(str(e).split())[:300]}); plan without --batch/--seq for the shape-only figures"
    )


def _with_ring(trace: Trace, module: nn.Module, stage: Stage, micro: tuple[int, int], dims: ParallelDims, cp_rotate: str) -> Trace:
    """``trace`` with ring attention's buffers of the stage's own attention layers (``cp`` > 1)."""
    if dims.cp == 1:
        return trace
    ring = ring_attention(module, stage.plan, cp=dims.cp, tp=dims.tp, rotate_method=cp_rotate, batch=micro[0], seq=micro[1])
    return with_ring_buffers(trace, ring)


def _trace_stages(
    model: nn.Module,
    pipeline: Pipeline,
    modules: Sequence[nn.Module],
    micro: tuple[int, int],
    mesh: DeviceMesh,
    dims: ParallelDims,
    cp_rotate: str,
) -> list[StageTrace]:
    """Every stage's step, in pipeline order: each stage receives what the
    one before it hands on. A CP rank's stage runs ``seq / cp`` tokens (what
    it receives and sends too); the ring buffers of the stage's own
    attention layers are added to its trace."""
    vocab = vocab_size(model)
    out: list[StageTrace] = []
    received: ActivationMeta | None = None
    for stage, module in zip(pipeline.stages, modules):
        try:
            traced = trace_stage(
                module,
                index=stage.index,
                num_stages=len(pipeline.stages),
                schedule=pipeline.schedule,
                microbatches=pipeline.microbatches,
                micro_batch=micro[0],
                seq=micro[1] // dims.cp,
                vocab=vocab,
                received=received,
                units=[u.modules[0] for u in stage.plan.units],
                mesh=mesh,
            )
        except (TypeError, RuntimeError, NotImplementedError) as e:
            raise _untraceable(f"stage {stage.index}", e) from None
        out.append(dataclasses.replace(traced, trace=_with_ring(traced.trace, module, stage, micro, dims, cp_rotate)))
        received = traced.sent
    return out


def _trace_ranks(
    model: nn.Module,
    pipeline: Pipeline,
    modules: Sequence[nn.Module],
    micro: tuple[int, int],
    mesh: DeviceMesh,
    dims: ParallelDims,
    cp_rotate: str,
) -> tuple[RankTrace, ...]:
    """Every pipeline rank's step when each runs several stages, rank by
    rank: a stage receives what its sender (on the rank before) hands on;
    rank 0's later stages, whose senders come after it, take what its first
    stage hands on, checked against their senders' traces once all ran."""
    vocab = vocab_size(model)
    sent: dict[int, ActivationMeta | None] = {}
    out: list[RankTrace] = []
    for r in range(pipeline.size):
        mine = pipeline.stages_of(r)
        known = {s.index: meta for s in mine if s.index > 0 and (meta := sent.get(s.index - 1)) is not None}
        try:
            traced = trace_rank(
                {s.index: modules[s.index] for s in mine},
                rank=r,
                num_stages=len(pipeline.stages),
                stages_per_rank=pipeline.stages_per_rank,
                microbatches=pipeline.microbatches,
                micro_batch=micro[0],
                seq=micro[1] // dims.cp,
                vocab=vocab,
                received=known,
                units=[u.modules[0] for s in mine for u in s.plan.units],
                mesh=mesh,
            )
        except (TypeError, RuntimeError, NotImplementedError) as e:
            raise _untraceable(f"pipeline rank {r}", e) from None
        trace = traced.trace
        if dims.cp > 1:  # one ring over the attention layers of all the rank's stages
            rings = [
                ring_attention(modules[s.index], s.plan, cp=dims.cp, tp=dims.tp, rotate_method=cp_rotate, batch=micro[0], seq=micro[1])
                for s in mine
            ]
            trace = with_ring_buffers(trace, dataclasses.replace(rings[0], layers=tuple(x for ring in rings for x in ring.layers)))
        out.append(dataclasses.replace(traced, trace=trace))
        sent.update(traced.sent)
    for rank in out:
        for s, got in rank.received.items():
            if s > 0 and got != sent[s - 1]:
                raise UsageError(
                    f"stage {s} on pipeline rank {rank.rank} was traced receiving {got}, but stage {s - 1} hands on "
                    f"{sent[s - 1]}; the interleaved trace needs every stage but the last to hand on the same shape"
                )
    return tuple(out)


# --------------------------------------------------------------------------- the report


def _held(memory: dict[str, Any], units: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What a pipelined step holds besides activations: nothing reshards,
    so every unit stays gathered, and the unsharded gradients of every unit
    accumulate in the reduce dtype until the one reduce-scatter after the
    last micro-batch."""
    gathered = sum(u["gathered_bytes"] for u in units)
    accumulated = sum(u["reduce_scatter_input_bytes"] for u in units)
    steady = memory["params_bytes"] + memory["grads_bytes"] + memory["optimizer_bytes"]
    return {"gathered_bytes": gathered, "accumulated_grads_bytes": accumulated, "held_bytes": steady + gathered + accumulated}


_NOT_PIPELINED = (
    "peak_forward_bytes",
    "peak_forward_gathered_bytes",
    "peak_forward_at",
    "peak_backward_bytes",
    "peak_backward_gathered_bytes",
    "peak_backward_at",
)


def _meta_json(meta: ActivationMeta | None) -> dict[str, Any] | None:
    return None if meta is None else {"shape": list(meta.shape), "dtype": str(meta.dtype).removeprefix("torch.")}


def traced_peak(
    t: StageTrace | RankTrace, shards: dict[str, ParamShard], micro: tuple[int, int], optimizer: str, *, offload: bool = False
) -> tuple[MemoryEstimate, int]:
    """One stage's (or one rank's) traced step as a :class:`MemoryEstimate`
    of ``shards``, and the position of its peak among the trace's samples
    (which micro-batch and stage ran then)."""
    estimate = estimate_from_trace(t.trace, shards, batch=micro[0], seq=micro[1], optimizer=optimizer, offload=offload)
    target = (0, 0, 0) if offload else steady_bytes(shards, optimizer)
    _, position, _ = rescale(t.trace, traced=traced_steady(t.trace), target=target)
    return estimate, position


def _traced_json(
    t: StageTrace | RankTrace, shards: dict[str, ParamShard], micro: tuple[int, int], optimizer: str, offload: bool
) -> dict[str, Any]:
    """The traced figures of one stage (or one rank of several stages), in
    :class:`MemoryEstimate`'s keys plus the pipeline's own (in flight, per
    micro-batch, P2P buffers)."""
    estimate, position = traced_peak(t, shards, micro, optimizer, offload=offload)
    at = where_label(t.trace.samples[position])
    if isinstance(t, RankTrace):
        action = t.action_at(position)
        at += "" if action is None else f", stage {action[1]}, micro-batch {action[2]}"
        received: Any = {str(s): _meta_json(m) for s, m in t.received.items()}
        sent: Any = {str(s): _meta_json(m) for s, m in t.sent.items()}
    else:
        mb = t.microbatch_at(position)
        at += "" if mb is None else f", micro-batch {mb}"
        received, sent = _meta_json(t.received), _meta_json(t.sent)
    data = estimate.to_json()
    data.update(
        {
            "microbatch": micro[0],
            "in_flight_microbatches": t.in_flight,
            "activations_per_microbatch_bytes": t.activations_per_microbatch,
            "p2p_buffer_bytes": t.p2p_buffer_bytes,
            "input_grad_bytes": t.input_grad_bytes,
            "received": received,
            "sent": sent,
            "peak_at": at,
        }
    )
    if isinstance(t, RankTrace):
        action = t.action_at(position)
        data["peak_stage"] = None if action is None else action[1]
    del data["batch"]
    return data


def pipeline_report(
    name: str, shape: Sequence[int], names: Sequence[str], run: PipelineRun, optimizer: str, report: Report, *, offload: bool = False
) -> dict[str, Any]:
    """The pipelined report as JSON-ready data: the whole job's keys as the
    plain report has them (model, mesh, dims, ...), ``pipeline``, one entry
    per stage under ``stages`` (its Plan's report: units, rows, step and
    memory, plus what a pipelined step holds and, traced, its step), one per
    pipeline rank under ``ranks``, and under ``memory`` the rank that peaks
    highest (``pp_rank``, ``stages``)."""
    pipeline = run.pipeline
    stages = []
    policy = None
    for sr in run.stages:
        stage = sr.stage
        full = report(name, shape, names, DryRun(stage.plan, run.dims, sr.shards, run.applied, run.params), optimizer)
        policy = full["mp_policy"]
        memory = {k: v for k, v in full["memory"].items() if k not in _NOT_PIPELINED}
        memory.update(_held(memory, full["units"]))
        if sr.trace is not None and run.micro_batch is not None:
            memory.update(_traced_json(sr.trace, sr.shards, run.micro_batch, optimizer, offload))
        stages.append(
            {
                "index": stage.index,
                "rank": stage.rank,
                "modules": list(stage.modules),
                "numel": stage.numel,
                "bytes": stage.nbytes,
                "warnings": list(stage.plan.warnings),
                "units": full["units"],
                "rows": full["rows"],
                "step": full["step"],
                "memory": memory,
                "tp_replica_reductions": full["tp_replica_reductions"],
                "tp_replica_sync_excluded": full["tp_replica_sync_excluded"],
            }
        )
    traced = run.micro_batch is not None
    by_rank = {t.rank: t for t in run.ranks}
    ranks: list[dict[str, Any]] = []
    for r in range(pipeline.size):
        mine = [s for s in stages if s["rank"] == r]
        totals: dict[str, Any] = {
            k: sum(s["memory"][k] for s in mine) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "held_bytes")
        }
        if r in by_rank and run.micro_batch is not None:  # several stages traced together: the rank's own step
            shards = {fqn: sh for sr in run.stages if sr.stage.rank == r for fqn, sh in sr.shards.items()}
            totals["traced"] = _traced_json(by_rank[r], shards, run.micro_batch, optimizer, offload)
            totals["peak_bytes"] = totals["traced"]["peak_bytes"]
        elif traced:  # one stage per rank: its traced step is the rank's
            totals["peak_bytes"] = max(s["memory"]["peak_bytes"] for s in mine)
        ranks.append({"rank": r, "stages": [s["index"] for s in mine], "memory": totals})
    key = "peak_bytes" if traced else "held_bytes"
    worst = max(ranks, key=lambda r: r["memory"][key])
    top = {"pp_rank": worst["rank"], "stages": worst["stages"], **{k: v for k, v in worst["memory"].items() if k != "traced"}}
    if traced and run.ranks:
        rank_trace = worst["memory"]["traced"]
        top["peak_stage"] = rank_trace["peak_stage"]
        top["peak_at"] = rank_trace["peak_at"]
        top["activations_bytes"] = rank_trace["activations_bytes"]
    elif traced:
        peak_stage = max((s for s in stages if s["rank"] == worst["rank"]), key=lambda s: s["memory"]["peak_bytes"])
        top["peak_stage"] = peak_stage["index"]
        top["peak_at"] = peak_stage["memory"]["peak_at"]
        top["activations_bytes"] = peak_stage["memory"]["activations_bytes"]
    model_bytes = sum(s.numel * s.dtype.itemsize for sr in run.stages for s in sr.shards.values())
    return {
        "warnings": list(run.plan.warnings) + [f"stage {s['index']}: {w}" for s in stages for w in s["warnings"]],
        "model": name,
        "mesh": dict(zip(names, shape)),
        "world_size": math.prod(shape),
        "dims": dataclasses.asdict(run.dims),
        "moe_mesh": None,
        "applied": run.applied,
        "mp_policy": policy,
        "model_bytes": model_bytes,
        "pipeline": {
            "schedule": pipeline.schedule,
            "microbatches": pipeline.microbatches,
            "size": pipeline.size,
            "stages_per_rank": pipeline.stages_per_rank,
            "placement": pipeline.placement,
            "container": pipeline.container,
            "bubble_fraction": bubble_fraction(pipeline.size, pipeline.microbatches, pipeline.stages_per_rank),
            "microbatch": None if run.micro_batch is None else run.micro_batch[0],
        },
        "stages": stages,
        "ranks": ranks,
        "units": [],
        "bytes_per_rank": worst["memory"]["params_bytes"],
        "memory": top,
    }


# --------------------------------------------------------------------------- the text


_APPLIED = {
    "full": (
        "every stage applied with its own Plan on the fake mesh, as apply_pipeline applies it on the ranks that run "
        "it; bytes per rank are rank 0's DTensor shards of each stage"
    ),
    "tp": (
        "TP applied to every stage on the fake mesh; FSDP shards computed from shapes (simulating fully_shard over "
        "this many ranks would take minutes)"
    ),
    "computed": "FSDP shards computed from shapes, not applied (simulating fully_shard over this many ranks would take minutes)",
    "none": "nothing to apply per stage (no TP, one data-parallel rank)",
}


def _mesh_line(data: dict[str, Any]) -> str:
    p, d = data["pipeline"], data["dims"]
    num = len(data["stages"])
    parts = [
        f"pipeline over pp={p['size']}: {num} stages ({p['stages_per_rank']} per rank, {p['placement']} placement), "
        f"schedule {p['schedule']}, {p['microbatches']} micro-batches (idle {p['bubble_fraction']:.0%} of each step)"
    ]
    if d["dp_replicate"] > 1:
        parts.append(f"each stage replicated over dp_replicate={d['dp_replicate']}")
    shard = d["dp_shard"] * d["cp"]
    parts.append(f"FSDP shards each stage over {shard} ranks" if shard > 1 else "no FSDP sharding")
    if d["cp"] > 1:
        parts.append(f"cp={d['cp']} folded into the shard dim, each CP rank holding seq/{d['cp']} of every activation")
    if d["tp"] > 1:
        parts.append(f"TP over {d['tp']} ranks")
    policy = data["mp_policy"]
    parts.append("mixed precision off" if policy is None else f"compute {policy['param_dtype']}, reduce {policy['reduce_dtype']}")
    return "; ".join(parts)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  " + "  ".join("-" * w for w in widths))
    return lines


def _exact(n: int) -> str:
    return f"{n:,} B"


def _memory_lines(data: dict[str, Any]) -> list[str]:
    stages = data["stages"]
    optimizer = stages[0]["memory"]["optimizer"]
    rows = [("stage", "pp rank", "parameters", "gradients", f"optimizer ({optimizer})", "gathered", "accumulated grads", "held")]
    for s in stages:
        m = s["memory"]
        rows.append(
            (
                str(s["index"]),
                str(s["rank"]),
                _exact(m["params_bytes"]),
                _exact(m["grads_bytes"]),
                _exact(m["optimizer_bytes"]),
                format_bytes(m["gathered_bytes"]),
                format_bytes(m["accumulated_grads_bytes"]),
                format_bytes(m["held_bytes"]),
            )
        )
    lines = ["memory per rank of each stage (rank 0's shards of the stage; activations not counted):", *_table(rows)]
    lines.append(
        "(parameters, gradients, optimizer: exact, FSDP padding included; gathered: every unit of the stage stays "
        "all-gathered through the step; accumulated grads: its unsharded gradients in the reduce dtype, kept until "
        "the one reduce-scatter after the last micro-batch; held: all of these together)"
    )
    if any(len(r["stages"]) > 1 for r in data["ranks"]):
        for r in data["ranks"]:
            m = r["memory"]
            lines.append(
                f"  pp rank {r['rank']} (stages {', '.join(map(str, r['stages']))}): parameters {_exact(m['params_bytes'])}, "
                f"gradients {_exact(m['grads_bytes'])}, optimizer {_exact(m['optimizer_bytes'])}, held {format_bytes(m['held_bytes'])}"
            )
    return lines


def _traced_cells(m: dict[str, Any]) -> tuple[str, ...]:
    """A traced stage's (or rank's) row: in flight, activations, per micro-batch, p2p buffers, peak, where."""
    return (
        str(m["in_flight_microbatches"]),
        format_bytes(m["activations_bytes"]),
        format_bytes(m["activations_per_microbatch_bytes"]),
        format_bytes(m["p2p_buffer_bytes"]),
        f"{format_bytes(m['peak_bytes'])} ({_exact(m['peak_bytes'])})",
        m["peak_at"],
    )


def _breakdown(m: dict[str, Any]) -> str:
    """The peak's parts, largest first."""
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(m["peak_breakdown"].items(), key=lambda kv: -kv[1]))


def _trace_lines(data: dict[str, Any]) -> list[str]:
    stages = data["stages"]
    first = stages[0]["memory"]
    p = data["pipeline"]
    rows: list[tuple[str, ...]] = [("stage", "in flight", "activations", "per micro-batch", "p2p buffers", "peak", "at")]
    for s in stages:
        rows.append((str(s["index"]), *_traced_cells(s["memory"])))
    top = data["memory"]
    breakdown = _breakdown(stages[top["peak_stage"]]["memory"])
    cp = data["dims"]["cp"]
    cp_part = f" ({first['seq'] // cp} per CP rank)" if cp > 1 else ""
    lines = [
        "",
        f"one training step of each stage traced ({p['schedule']}: {p['microbatches']} micro-batches of "
        f"{first['microbatch']} x seq {first['seq']}{cp_part} per data-parallel rank; forwards and backwards in the schedule's "
        "order, one reduce-scatter after the last, AdamW step; FakeTensorMode, FSDPMemTracker):",
        *_table(rows),
        "(activations: the most saved for backward at the end of a forward, with the micro-batches then in flight; "
        "p2p buffers: torch's receive buffers, one input and one output gradient per micro-batch, kept for the job)",
        f"  peak stage  {top['peak_stage']} on pp rank {top['pp_rank']}: {format_bytes(top['peak_bytes'])} "
        f"({_exact(top['peak_bytes'])}) in the {top['peak_at']}",
        f"  at the peak {breakdown}",
    ]
    lines += [f"  estimated   stage {s['index']}: {n}" for s in stages for n in s["memory"]["estimated"]]
    return lines


def _rank_trace_lines(data: dict[str, Any]) -> list[str]:
    """The traced step of each pipeline rank that runs several stages."""
    p = data["pipeline"]
    ranks = [(r, r["memory"]["traced"]) for r in data["ranks"]]
    first = ranks[0][1]
    rows: list[tuple[str, ...]] = [("pp rank", "stages", "most in flight", "activations", "per micro-batch", "p2p buffers", "peak", "at")]
    for r, t in ranks:
        rows.append((str(r["rank"]), ", ".join(map(str, r["stages"])), *_traced_cells(t)))
    top = data["memory"]
    breakdown = _breakdown(data["ranks"][top["pp_rank"]]["memory"]["traced"])
    cp = data["dims"]["cp"]
    cp_part = f" ({first['seq'] // cp} per CP rank)" if cp > 1 else ""
    lines = [
        "",
        f"one training step of each pipeline rank traced ({p['schedule']}: {p['microbatches']} micro-batches of "
        f"{first['microbatch']} x seq {first['seq']}{cp_part} per data-parallel rank; the rank's stages' forwards and "
        "backwards in the order torch's schedule gives it, one reduce-scatter per stage after the last, one AdamW step; "
        "FakeTensorMode, FSDPMemTracker over all the rank's stages):",
        *_table(rows),
        "(activations: the most saved for backward at the end of a forward, over all the rank's stages; most in flight: "
        "micro-batches of its stages held at once; p2p buffers: torch's receive buffers of every stage of the rank)",
        f"  peak rank   {top['pp_rank']}: {format_bytes(top['peak_bytes'])} ({_exact(top['peak_bytes'])}) in the {top['peak_at']}",
        f"  at the peak {breakdown}",
    ]
    lines += [f"  estimated   pp rank {r['rank']}: {n}" for r, t in ranks for n in t["estimated"]]
    return lines


def render_pipeline(data: dict[str, Any], p: Plan) -> str:
    """The text report of :func:`pipeline_report`: the Plan (its stage table
    and every stage's plan), then each stage's memory per rank."""
    mesh = ", ".join(f"{k}={v}" for k, v in data["mesh"].items())
    lines = [f"warning: {w}" for w in data["warnings"]] + [
        f"fsdptx plan: {data['model']} on a fake mesh {mesh} ({data['world_size']} ranks)",
        _mesh_line(data),
        _APPLIED[data["applied"]],
        "",
    ]
    plan_text = str(p).splitlines()
    lines += [line for line in plan_text if not line.startswith("warning")]
    lines += ["", *_memory_lines(data)]
    if any("traced" in r["memory"] for r in data["ranks"]):
        lines += _rank_trace_lines(data)
    elif "peak_stage" in data["memory"]:
        lines += _trace_lines(data)
    return "\n".join(lines)


def run_pipeline_plan(
    args: argparse.Namespace,
    model: nn.Module,
    name: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    config: Any,
    batch_seq: tuple[int, int] | None,
    report: Report,
) -> str:
    """``plan`` with a ``pp`` axis: the pipelined dry run, its report as
    text or (``--json``) JSON. ``config`` carries ``pipeline_parallel``."""
    try:
        run = pipeline_dry_run(
            model,
            shape,
            names,
            config,
            batch_seq=batch_seq,
            batch_given=args.batch is not None,
            cp_rotate=args.cp_rotate or "allgather",
        )
    except (ValueError, PlanningError) as e:  # the planner's own message names what to change
        raise UsageError(f"cannot plan {name}: {_one_line(e)}") from None
    data = pipeline_report(name, shape, names, run, args.optimizer, report, offload=args.offload)
    if args.html is not None:
        from ._html import write_pipeline_html

        write_pipeline_html(args.html, data, run)
    if args.json:
        return json.dumps({**data, "plan": plan_document(run.plan)}, indent=2)
    return render_pipeline(data, run.plan)
