"""``python -m fsdptx plan --fit GPUSxMEMORY``: which parallelizations fit.

Every mesh the world allows (``dp_replicate`` x ``dp_shard`` x ``tp``,
``tp`` up to 8 and only where the model's TP plan divides), activation
checkpointing off / selective / full, and optimizer-state offload off / on,
each with its predicted per-rank peak and its communication per step. With
``--ep N`` each mesh also splits the experts across ``N`` of its shard x TP
ranks (:attr:`Candidate.moe_mesh`).

Each candidate's peak is the one ``plan`` traces with the candidate's own
options (tests compare them), at a fraction of the traces:

- Nothing in a step depends on how many replicas HSDP has, only on whether
  it replicates: replicated meshes are traced with ``dp_replicate=2``.
- A step depends on the FSDP shard count only through parts that are one
  shard of something (:mod:`fsdptx.cli._scaling`): shard counts up to
  ``REFERENCE_SHARDS[-1]`` are traced themselves, every larger one is
  derived from the traces at :data:`REFERENCE_SHARDS`, exactly where no
  parameter pads. So a (``tp``, checkpointing, replicated or not) setting
  takes at most three traces, whatever the world size. The sharded
  parameters, gradients and optimizer state are then sized exactly for
  the mesh; offload moves exactly those to the host, so its device peak is
  the same step without them.
- A model with more than :data:`TRACE_LAYERS` blocks (a preset or ``--hf``
  model: their block count can be set) is traced with ``TRACE_LAYERS - 1``
  and ``TRACE_LAYERS`` blocks and the peak, activations and TP traffic
  extrapolated linearly: each further block adds one more block's
  activations, parameters and collectives. Fewer blocks: traced whole, exact.

A setting the planner or the model refuses (a TP size that does not divide
the sequence, a TP plan that does not divide) is skipped and listed with
why; the others are still evaluated.

Communication per step and rank is what each rank sends or receives on the
wire (ring algorithms): an all-gather or reduce-scatter of ``B`` bytes over
``n`` ranks moves ``B (n-1)/n``, an all-reduce ``2 B (n-1)/n``. FSDP's
come from the plan's units (two all-gathers for a unit that reshards after
forward, one reduce-scatter), each of the rank's TP shard of them, HSDP's all-reduce of the sharded gradients
over ``dp_replicate``, TP's from the traced step. Offload adds its host
copies (at least the sharded parameters to the device and the sharded
gradients back, per step).

Those that fit, within the budget less ``--headroom``, are ranked by the
tokens per second per GPU of the step :mod:`fsdptx.cli._hardware` predicts
from those bytes, the links they cross and the step's FLOPs: bytes alone weigh a PCIe byte like an
NVLink byte and a byte hidden behind compute like an exposed one.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..plan._plan import Plan
from ..model._index import PlanningError
from ..plan._stages import microbatch_problem
from ._fit_dims import StageShares, cp_ring_bytes, p2p_bytes, pipeline_peak, stage_shares
from ._hardware import Hardware, StepTime, predict, step_flops
from ._memory import disable_kv_cache
from ._scaling import at_shard_count, rescale, steady_bytes, traced_steady
from ._trace import Trace
from ._report import ParamShard, ceil_div, step_traffic

__all__ = ["Candidate", "FitResult", "matmul_params", "parse_fit", "parse_headroom", "search"]

TRACE_LAYERS = 3
"""Models with more blocks are traced at ``TRACE_LAYERS - 1`` and
``TRACE_LAYERS`` blocks and extrapolated."""

MAX_TP = 8
"""Largest TP degree tried: TP collectives sit on the critical path of every
block, so beyond one node's GPUs (8 on common servers) it does not pay."""

_SIZES = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZES.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_FIT = re.compile(r"^\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)
AC_MODES: tuple[str | bool, ...] = (False, "selective", "full")
_RECOMPUTE = {False: 0, "selective": 1, "full": 2}
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*$", re.IGNORECASE)

DEFAULT_HEADROOM = "10%"
"""Memory per GPU the search leaves out of the budget: the CUDA context
(0.5-1 GiB), NCCL's communicator buffers and the caching allocator's
fragmentation, none of which the traced step holds; 10% of 80 GiB is 8 GiB."""


def parse_headroom(text: str, budget: int) -> int:
    """``--headroom``: ``"10%"`` of ``budget`` or bytes such as ``"4GiB"``, in bytes.

    Raises:
        ValueError: naming the text: not a percentage or a size, or leaving
            no memory of ``budget``.
    """
    if (m := _PERCENT.match(text)) is not None:
        headroom = int(budget * float(m.group(1)) / 100)
    elif (m := _BYTES.match(text)) is not None:
        headroom = int(float(m.group(1)) * _SIZES[m.group(2).upper()])
    elif text.strip() == "0":
        headroom = 0
    else:
        raise ValueError(f"malformed --headroom {text!r}: expected a percentage such as 10% or a size such as 4GiB")
    if headroom >= budget:
        raise ValueError(f"--headroom {text!r} leaves nothing of the {budget:,} bytes per GPU that --fit gives")
    return headroom


def parse_fit(text: str) -> tuple[int, int]:
    """``"64x80GiB"`` -> ``(64, 85899345920)``: GPUs and bytes of memory each.

    Raises:
        ValueError: naming the text and what is wrong: not of the form, no
            GPU, more GPUs than the dry run simulates (``MAX_WORLD``), or
            less than one byte of memory.
    """
    from ._common import MAX_WORLD

    m = _FIT.match(text)
    if m is None:
        raise ValueError(f"malformed --fit {text!r}: expected GPUSxMEMORY such as 64x80GiB or 8x40GB")
    gpus, memory = int(m.group(1)), int(float(m.group(2)) * _SIZES[m.group(3).upper()])
    if gpus < 1:
        raise ValueError(f"--fit {text!r}: the number of GPUs must be at least 1")
    if gpus > MAX_WORLD:
        raise ValueError(f"--fit {text!r} has {gpus:,} GPUs; the dry run simulates at most {MAX_WORLD:,} ranks")
    if memory < 1:
        raise ValueError(f"--fit {text!r}: the memory per GPU must be at least 1 byte, e.g. 80GiB")
    return gpus, memory


@dataclass(frozen=True)
class Candidate:
    """One parallelization: its mesh, checkpointing and offload, what it is
    predicted to hold per rank at its peak, and what it communicates."""

    mesh: dict[str, int]
    activation_checkpointing: str | bool
    offload: bool
    peak_bytes: int
    activations_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    comm_bytes: dict[str, int]
    extrapolated: bool
    mp: str = "bf16"  # the dry run's --mp: bf16 is FSDP2Config's default policy
    ep: int = 1  # experts split across this many ranks (--fit --ep)
    step: StepTime | None = None  # predicted by the search's hardware model
    schedule: str | None = None  # with a pp dim: the pipeline schedule
    microbatches: int = 1  # with a pp dim: micro-batches per step
    peak_stage: int | None = None  # with a pp dim: the stage that peaks (modelled)

    @property
    def predicted(self) -> StepTime:
        if self.step is None:
            raise ValueError(f"--mesh {self.mesh_arg}: no step time predicted")
        return self.step

    @property
    def comm_total(self) -> int:
        return sum(self.comm_bytes.values())

    @property
    def mesh_arg(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.mesh.items())

    @property
    def sequence_parallel(self) -> bool:
        """Every candidate with TP splits the sequence too (the traces are of
        SP steps)."""
        return self.mesh.get("tp", 1) > 1

    @property
    def moe_mesh(self) -> dict[str, int] | None:
        """The experts' mesh under ``--ep``: the dense mesh's replicate dim,
        then its shard and TP ranks regrouped as ``ep_shard x ep``."""
        if self.ep == 1:
            return None
        rep = self.mesh.get("dp_replicate", 1)
        shard = self.mesh["dp_shard"] * self.mesh.get("tp", 1) // self.ep
        return {**({"dp_replicate": rep} if rep > 1 else {}), "ep_shard": shard, "ep": self.ep}

    def config_text(self) -> str:
        """The ``FSDP2Config`` that reproduces this candidate (beside the
        dry run's mixed-precision policy)."""
        parts = []
        if self.sequence_parallel:
            parts.append("sequence_parallel=True")
        if self.schedule is not None:
            parts.append(
                f"pipeline_parallel=PipelineParallelConfig(schedule={self.schedule!r}, microbatches={self.microbatches})"
            )
        if self.activation_checkpointing:
            parts.append(f"activation_checkpointing={self.activation_checkpointing!r}")
        if self.offload:
            parts.append("offload_policy=CPUOffloadPolicy()")
        if self.mp == "none":
            parts.append("mp_policy=None")
        elif self.mp != "bf16":
            dtype = {"fp16": "float16", "fp32": "float32"}[self.mp]
            parts.append(
                f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.{dtype}, reduce_dtype=torch.float32, "
                f"output_dtype=torch.{dtype})"
            )
        config = f"FSDP2Config({', '.join(parts)})"
        moe = self.moe_mesh
        if moe is None:
            return config
        return f"{config}, moe_mesh=init_device_mesh(..., {tuple(moe.values())}, mesh_dim_names={tuple(moe)})"

    def cli_args(self) -> list[str]:
        """``python -m fsdptx plan`` options that re-plan this candidate."""
        args = ["--mesh", self.mesh_arg]
        moe = self.moe_mesh
        if moe is not None:
            args += ["--moe-mesh", ",".join(f"{k}={v}" for k, v in moe.items())]
        if self.sequence_parallel:
            args.append("--sp")
        if self.schedule is not None:
            args += ["--schedule", self.schedule, "--microbatches", str(self.microbatches)]
        if self.activation_checkpointing:
            args += ["--ac", str(self.activation_checkpointing)]
        if self.offload:
            args.append("--offload")
        if self.mp != "bf16":
            args += ["--mp", self.mp]
        return args

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": self.mesh,
            "moe_mesh": self.moe_mesh,
            "activation_checkpointing": self.activation_checkpointing or None,
            "offload": self.offload,
            "peak_bytes": self.peak_bytes,
            "activations_bytes": self.activations_bytes,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "comm_bytes": self.comm_bytes,
            "comm_total_bytes": self.comm_total,
            "predicted_step": None if self.step is None else self.step.to_json(),
            "extrapolated": self.extrapolated,
            "pipeline": None
            if self.schedule is None
            else {"schedule": self.schedule, "microbatches": self.microbatches, "peak_stage": self.peak_stage, "modelled": True},
            "config": self.config_text(),
            "argv": self.cli_args(),
        }


@dataclass(frozen=True)
class FitResult:
    """All candidates evaluated, and those that fit within ``budget`` less
    ``headroom``, best first."""

    gpus: int
    budget: int
    headroom: int
    hardware: Hardware
    candidates: tuple[Candidate, ...]
    fitting: tuple[Candidate, ...]
    skipped: tuple[str, ...]


def meshes(gpus: int, cp_sizes: Sequence[int] = (), pp_sizes: Sequence[int] = ()) -> list[dict[str, int]]:
    """Every ``pp x dp_replicate x dp_shard x cp x tp`` factorization of
    ``gpus`` (dims listed outermost first, as meshes are laid out) with
    ``tp <= MAX_TP``, ``cp`` in ``cp_sizes`` or 1, ``pp`` in ``pp_sizes`` or
    1, never both above 1 (the dry run plans no pipeline with a ``cp``
    dim), and at least two data-parallel ranks counting ``cp`` (FSDP
    shards over ``dp_shard x cp``; one rank has nothing to shard)."""
    out = []
    for pp in (1, *sorted(set(pp_sizes) - {1})):
        for cp in (1, *sorted(set(cp_sizes) - {1})) if pp == 1 else (1,):
            if gpus % (pp * cp):
                continue
            rest = gpus // (pp * cp)
            for tp in (t for t in range(1, min(rest, MAX_TP) + 1) if rest % t == 0):
                dp = rest // tp
                if dp * cp < 2:
                    continue
                for rep in (r for r in range(1, dp + 1) if dp % r == 0):
                    mesh = {"pp": pp, "dp_replicate": rep, "dp_shard": dp // rep, "cp": cp, "tp": tp}
                    out.append({k: v for k, v in mesh.items() if v > 1 or k == "dp_shard"})
    return out


REFERENCE_SHARDS = (2, 4)
"""FSDP shard counts traced to stand for every larger one: each sample of a
step is a fixed part plus a part that goes as one over the shard count
(:func:`fsdptx.cli._scaling.at_shard_count`), and these two traces give
both. Smaller shard counts are traced themselves (one shard takes FSDP2's
copy path instead of collectives, so it is a step of its own)."""


def shard_points(needed: Iterable[int]) -> tuple[int, ...]:
    """The shard counts to trace for candidates at ``needed`` shard counts:
    each one up to ``REFERENCE_SHARDS[-1]`` itself, and the reference pair
    for any larger one."""
    needed = set(needed)
    points = {s for s in needed if s <= REFERENCE_SHARDS[-1]}
    if any(s > REFERENCE_SHARDS[-1] for s in needed):
        points.update(REFERENCE_SHARDS)
    return tuple(sorted(points))


@dataclass(frozen=True)
class _Measured:
    """The traces of one (tp, checkpointing, replicated or not) setting:
    per traced block count, the traces by FSDP shard count and the shard
    function of the traced model."""

    traces: tuple[tuple[int, Mapping[int, Trace], Callable[[int], dict[str, ParamShard]]], ...]


def trace_at(points: Mapping[int, Trace], shards: int) -> Trace:
    """The step at ``shards`` FSDP ranks: traced, or from the reference pair."""
    if shards in points:
        return points[shards]
    a, b = REFERENCE_SHARDS
    return at_shard_count(points[a], a, points[b], b, shards)


def _ring(nbytes: float, n: int, factor: int = 1) -> int:
    return int(factor * nbytes * (n - 1) / n) if n > 1 else 0


def _extrapolate(values: Sequence[tuple[int, float]], layers: int) -> int:
    if len(values) == 1:
        return int(values[0][1])
    (la, a), (lb, b) = values
    return int(round(b + (layers - lb) * (b - a) / (lb - la)))


def evaluate(
    mesh: dict[str, int],
    ac: str | bool,
    offload: bool,
    measured: _Measured,
    full_shards: dict[str, ParamShard],
    full_plan: Plan,
    layers: int,
    optimizer: str,
    ep: int = 1,
) -> Candidate:
    """Predict one candidate from the traces of its (tp, checkpointing,
    replication): the step at its shard count, with the sharded parts
    sized as ``plan`` sizes them for this mesh; ``full_shards`` (and the
    traces' shard functions) already split the experts across ``ep``.

    Raises:
        ValueError: the reference traces are not the same step, so the
            shard count cannot be derived from them."""
    shard = mesh["dp_shard"]
    rep = mesh.get("dp_replicate", 1)
    tp = mesh.get("tp", 1)
    cp = mesh.get("cp", 1)
    peaks: list[tuple[int, float]] = []
    acts: list[tuple[int, float]] = []
    tp_comm: list[tuple[int, float]] = []
    ring = None
    for n_layers, points, shards_at in measured.traces:
        trace = trace_at(points, shard)
        ring = trace.ring if trace.ring is not None else ring
        target = (0, 0, 0) if offload else steady_bytes(shards_at(shard * cp), optimizer)
        peak, _, _ = rescale(trace, traced=traced_steady(trace), target=target)
        peaks.append((n_layers, peak))
        acts.append((n_layers, trace.activations))
        tp_comm.append((n_layers, sum(c.bytes for c in trace.collectives if c.source == "tp")))
    params, grads, states = steady_bytes(full_shards, optimizer)
    comm: dict[str, int] = {}
    gathered = reduced = 0.0
    for unit, traffic in zip(full_plan.units, step_traffic(full_plan)):
        share = _tp_local_share(unit.params, full_shards, tp)
        gathered += traffic.all_gather_bytes * share
        reduced += traffic.reduce_scatter_bytes * share
    comm["fsdp_all_gather"] = _ring(gathered, shard * cp)
    comm["fsdp_reduce_scatter"] = _ring(reduced, shard * cp)
    grad_numel = sum(s.local_numel for s in full_shards.values() if s.requires_grad)
    comm["hsdp_all_reduce"] = _ring(4 * grad_numel, rep, 2)  # fp32, the dry run's reduce dtype
    comm["tp"] = _ring(_extrapolate(tp_comm, layers), tp)
    if ring is not None:
        comm["cp_ring"] = cp_ring_bytes(ring, layers or len(ring.layers), ac)
    if offload:  # host links, not the network: at least one copy of each sharded part each way
        comm["offload_host_copies"] = params + grads
    return Candidate(
        mesh=mesh,
        activation_checkpointing=ac,
        offload=offload,
        peak_bytes=_extrapolate(peaks, layers),
        activations_bytes=_extrapolate(acts, layers),
        params_bytes=0 if offload else params,
        grads_bytes=0 if offload else grads,
        optimizer_bytes=0 if offload else states,
        comm_bytes=comm,
        extrapolated=len(measured.traces) > 1,
        ep=ep,
    )


def evaluate_pipeline(
    mesh: dict[str, int],
    ac: str | bool,
    offload: bool,
    measured: _Measured,
    shards: dict[str, ParamShard],
    layers: int,
    optimizer: str,
    pipe: _Pipe,
) -> Candidate:
    """Model one pipeline candidate (:mod:`fsdptx.cli._fit_dims`) from the
    traces of its (tp, checkpointing, replication) at its shard count:
    the activations one block adds, the rest, and the step's transient
    peak, then each stage of the planner's split.

    Raises:
        ValueError: the schedule cannot run the micro-batches on these stages."""
    shard, rep, tp = mesh["dp_shard"], mesh.get("dp_replicate", 1), mesh.get("tp", 1)
    acts: list[tuple[int, float]] = []
    by_tokens = by_params = 0
    tp_comm: list[tuple[int, float]] = []
    for n_layers, points, shards_at in measured.traces:
        trace = trace_at(points, shard)
        _, _, at_peak = rescale(trace, traced=traced_steady(trace), target=steady_bytes(shards_at(shard), optimizer))
        # transients: the operators' temporaries and inputs grow with the tokens (the largest the
        # step holds: a stage may peak where the whole model does not, at its head), the buffers of
        # a unit's collectives and its unsharded gradients with its parameters (as at the peak)
        by_tokens = max(
            by_tokens, max((x.bytes.get("temporaries", 0) + x.bytes.get("inputs", 0) for x in trace.samples), default=0)
        )
        by_params = max(by_params, sum(at_peak.get(k, 0) for k in _UNIT_TRANSIENTS))
        acts.append((n_layers, trace.activations))
        tp_comm.append((n_layers, sum(c.bytes for c in trace.collectives if c.source == "tp")))
    if len(acts) == 2:
        (la, a), (lb, b) = acts
        block, rest = (b - a) / (lb - la), a - la * (b - a) / (lb - la)
    else:
        block, rest = acts[0][1] / max(layers or acts[0][0], 1), 0.0
    total = layers or sum(pipe.shares.blocks)
    found = pipeline_peak(
        pipe.shares,
        shards,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches,
        tp=tp,
        block_activations=block,
        rest_activations=rest,
        token_transient=by_tokens,
        unit_transient=by_params,
        batch=pipe.batch,
        seq=pipe.seq,
        sequence_parallel=tp > 1,
        compute_dtype=pipe.compute_dtype,
        optimizer=optimizer,
        offload=offload,
    )
    busiest = found.gathered_bytes.index(max(found.gathered_bytes))
    grad_numel = found.grad_numel[busiest]
    comm = {
        "fsdp_all_gather": _ring(found.gathered_bytes[busiest], shard),  # gathered once: no reshard under PP
        "fsdp_reduce_scatter": _ring(4 * grad_numel, shard),  # fp32, once per step
        "hsdp_all_reduce": _ring(4 * grad_numel, rep, 2),
        "tp": _ring(_extrapolate(tp_comm, layers) * found.most_blocks / total, tp),
        "pp_p2p": p2p_bytes(
            pipe.shares, batch=pipe.batch, seq=pipe.seq, tp=tp, sequence_parallel=tp > 1, dtype=pipe.compute_dtype
        ),
    }
    if offload:
        held = steady_bytes({f: shards[f] for f in pipe.shares.params[busiest] if f in shards}, optimizer)
        comm["offload_host_copies"] = held[0] + held[1]
    return Candidate(
        mesh=mesh,
        activation_checkpointing=ac,
        offload=offload,
        peak_bytes=found.peak_bytes,
        activations_bytes=found.activations_bytes,
        params_bytes=found.params_bytes,
        grads_bytes=found.grads_bytes,
        optimizer_bytes=found.optimizer_bytes,
        comm_bytes=comm,
        extrapolated=len(measured.traces) > 1,
        schedule=pipe.schedule,
        microbatches=pipe.microbatches,
        peak_stage=found.stage,
    )


_UNIT_TRANSIENTS = ("all_gather_buffers", "reduce_scatter_buffers", "unsharded_grads")


@dataclass(frozen=True)
class _Pipe:
    """What every pipeline candidate of one size shares: the split, the
    schedule and its micro-batches, the step's batch and sequence, and the
    units' compute dtype."""

    shares: StageShares
    schedule: str
    microbatches: int
    batch: int
    seq: int
    compute_dtype: torch.dtype | None


def _tp_local_share(params: Sequence[str], shards: Mapping[str, ParamShard], tp: int) -> float:
    """The share of a unit's elements one TP rank holds, so gathers: FSDP
    shards each rank's TP shard (``numel / tp`` of a TP-split parameter, all
    of a replicated one), not the whole parameter the plan's unit counts."""
    known = [shards[f] for f in params if f in shards]
    whole = sum(s.numel for s in known)
    if whole == 0:
        return 1.0
    return sum(ceil_div(s.numel, tp) if s.tp_sharded else s.numel for s in known) / whole


def shards_for(model: nn.Module, plan: Plan, dims: Any, ep: int = 1) -> Callable[[int], dict[str, ParamShard]]:
    """Rank 0's shards of ``model`` (TP applied) for any FSDP shard count.

    With ``ep`` > 1 the experts (the plan's units on the MoE mesh) are
    split across ``ep`` and FSDP-sharded over the rest of the shard and TP
    ranks, as :attr:`Candidate.moe_mesh` lays them out."""
    from ..plan.transforms import expert_parallel
    from ._common import param_shards

    split = expert_parallel(model, plan) if ep > 1 else plan
    if split.expert_parallel is not None:
        uneven = [f"{m} ({n} experts)" for m, n in zip(split.expert_parallel.modules, split.expert_parallel.num_experts) if n % ep]
        if uneven:
            raise ValueError(f"--ep {ep} does not divide the expert count of {', '.join(uneven[:3])}")

    def at(dp_shard: int) -> dict[str, ParamShard]:
        moe = (dp_shard * dims.tp // ep, ep) if ep > 1 else None
        return param_shards(model, split, dataclasses.replace(dims, dp_shard=dp_shard), fsdp_applied=False, moe=moe)

    return at


def rank(candidates: Sequence[Candidate], budget: int) -> tuple[Candidate, ...]:
    """Those within ``budget``, best first: the most tokens per second per
    GPU the predicted step gives (candidates train different global
    batches, so step times alone do not compare), then (on a tie) least
    recompute, no offload, least communication and the smallest peak.

    Raises:
        ValueError: a candidate without a predicted step time.
    """
    fitting = [c for c in candidates if c.peak_bytes <= budget]
    return tuple(
        sorted(
            fitting,
            key=lambda c: (
                -c.predicted.tokens_per_s,
                _RECOMPUTE[c.activation_checkpointing],
                c.offload,
                c.comm_total,
                c.peak_bytes,
            ),
        )
    )


def matmul_params(model: nn.Module) -> int:
    """Parameters that multiply activations, for the 6N rule: every distinct
    parameter but an embedding table's, which a lookup reads without
    FLOPs, unless another module (a tied head) uses it too."""
    found: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            found[id(p)] = p.numel()
    return sum(found.values())


def search(
    build: Callable[[int | None], nn.Module],
    layers: int | None,
    gpus: int,
    budget: int,
    *,
    batch: int,
    seq: int,
    optimizer: str,
    config: Callable[..., Any],
    hardware: Hardware,
    flops_params: int,
    headroom: int = 0,
    ep: int = 1,
    cp_sizes: Sequence[int] = (),
    pp_sizes: Sequence[int] = (),
    schedule: str = "1F1B",
    microbatches: int | None = None,
) -> FitResult:
    """Evaluate every candidate of a ``gpus``-rank world against ``budget`` bytes.

    Args:
        build: builds the model on the meta device with that many blocks
            (``None``: as it comes).
        layers: the model's block count when ``build`` can change it, else ``None``.
        gpus: the world size.
        budget: bytes of device memory per rank.
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        optimizer: ``adamw``, ``sgd`` or ``none``.
        config: ``FSDP2Config`` with the dry run's fixed settings bound.
        hardware: what the step times are predicted on.
        flops_params: the model's parameters that multiply
            (:func:`matmul_params`), for its FLOPs per token.
        headroom: bytes of ``budget`` left out of what a candidate may hold.
        ep: split the experts across this many ranks in every candidate
            (their MoE mesh: :attr:`Candidate.moe_mesh`); meshes whose
            shard x TP ranks it does not divide are skipped. The traces run
            with the experts whole (their forward needs the model's token
            dispatch), so gathered experts count whole: an upper bound.
        cp_sizes: context-parallel sizes to try besides 1 (traced at
            ``seq / cp`` with ring attention modelled).
        pp_sizes: pipeline sizes to try besides 1 (modelled from the
            traces of the same mesh without stages: :mod:`fsdptx.cli._fit_dims`).
        schedule: the pipeline candidates' schedule (1F1B or GPipe).
        microbatches: their micro-batches per step (``None``: ``batch``,
            one sequence each).

    Returns:
        A :class:`FitResult`.
    """
    from ._cp import cp_seq_error
    from ._run import dry_run

    if layers is not None and layers > TRACE_LAYERS:
        counts: tuple[int | None, ...] = (TRACE_LAYERS - 1, TRACE_LAYERS)
    else:
        counts = (layers,)
    candidates: list[Candidate] = []
    skipped: list[str] = []
    policy = config().mp_policy
    pipes, hugging_face = _pipes(
        build, pp_sizes, schedule, batch if microbatches is None else microbatches, batch, seq, policy, skipped
    )
    every = meshes(gpus, cp_sizes, tuple(pipes))
    fulls: dict[int, tuple[Any, Callable[[int], dict[str, ParamShard]]] | None] = {}
    for tp, cp in sorted({(m.get("tp", 1), m.get("cp", 1)) for m in every}):
        tp_meshes = [m for m in every if (m.get("tp", 1), m.get("cp", 1)) == (tp, cp)]
        uneven = [m for m in tp_meshes if (m["dp_shard"] * tp) % ep]
        skipped += [f"--mesh {_mesh_text(m)}: ep={ep} does not divide its dp_shard x tp ranks" for m in uneven]
        staged = [m for m in tp_meshes if m.get("pp", 1) > 1 and m not in uneven]
        if staged and ep > 1:
            skipped.append(f"tp={tp} with pp: the dry run plans no pipeline with a MoE mesh (--ep {ep})")
        elif staged and hugging_face and tp > 1:
            skipped.append(
                f"tp={tp} with pp: a Hugging Face model's pipeline stages run TP without sequence parallelism, "
                "which --fit does not trace"
            )
        else:
            staged = []
        tp_meshes = [m for m in tp_meshes if m not in uneven and m not in staged]
        if not tp_meshes:
            continue
        problem = cp_seq_error(seq, cp, tp, tp > 1) if cp > 1 else None
        if problem is None and seq % tp:
            problem = f"--seq {seq} is not divisible by {tp}; sequence parallelism splits every sequence over the TP ranks"
        label = f"tp={tp}" + (f", cp={cp}" if cp > 1 else "")
        if problem is not None:
            skipped.append(f"{label}: {problem}")
            continue
        if tp not in fulls:
            full_model = build(None)
            try:
                full = dry_run(
                    full_model, *_trace_mesh(tp, 2, False), config(sequence_parallel=tp > 1), moe=_trace_moe(tp, 2, False, ep)
                )
                fulls[tp] = (full, shards_for(full_model, full.plan, full.dims, ep))
            except ValueError as e:  # the TP plan does not divide: not a candidate
                fulls[tp] = None
                skipped.append(f"tp={tp}: {_short(e)}")
        known = fulls[tp]
        if known is None:
            continue
        full, full_at = known
        for ac in AC_MODES:
            for replicated in (False, True):
                group = [m for m in tp_meshes if (m.get("dp_replicate", 1) > 1) == replicated]
                if not group:
                    continue
                setting = config(sequence_parallel=tp > 1, activation_checkpointing=ac)
                points = shard_points(m["dp_shard"] for m in group)
                try:
                    measured = _measure(build, counts, tp, points, replicated, setting, ac, (batch, seq), ep, cp)
                except ValueError as e:  # the planner or the model refuses this setting: the others still count
                    skipped.append(f"{label}, ac={ac or 'off'}{', dp_replicate > 1' if replicated else ''}: {_short(e)}")
                    continue
                flops = step_flops(flops_params, batch * seq, ac) / (tp * cp)  # TP and CP split every matmul
                for mesh in group:
                    shards = full_at(mesh["dp_shard"] * cp)
                    pp = mesh.get("pp", 1)
                    try:
                        evaluated = [
                            evaluate(mesh, ac, offload, measured, shards, full.plan, layers or 0, optimizer, ep)
                            if pp == 1
                            else evaluate_pipeline(mesh, ac, offload, measured, shards, layers or 0, optimizer, pipes[pp])
                            for offload in (False, True)
                        ]
                    except ValueError as e:
                        skipped.append(f"--mesh {_mesh_text(mesh)} ac={ac or 'off'}: {_short(e)}")
                        continue
                    # a pipeline rank computes its stage's blocks (the busiest stage sets the pace)
                    # and idles (pp - 1) / microbatches of that in the bubble
                    share = 1.0 if pp == 1 else max(pipes[pp].shares.blocks) / sum(pipes[pp].shares.blocks)
                    bubble = 0.0 if pp == 1 else (pp - 1) / pipes[pp].microbatches
                    tokens = batch * seq / (tp * cp * pp)
                    candidates += [
                        dataclasses.replace(
                            c, step=predict(c.mesh, c.comm_bytes, flops * share, hardware, tokens=tokens, bubble=bubble)
                        )
                        for c in evaluated
                    ]
    return FitResult(
        gpus, budget, headroom, hardware, tuple(candidates), rank(candidates, budget - headroom), tuple(skipped)
    )


def _pipes(
    build: Callable[[int | None], nn.Module],
    pp_sizes: Sequence[int],
    schedule: str,
    microbatches: int,
    batch: int,
    seq: int,
    policy: Any,
    skipped: list[str],
) -> tuple[dict[int, _Pipe], bool]:
    """The split of the whole model for each pipeline size that can run
    (the others listed in ``skipped`` with why), and whether the model is a
    Hugging Face one (its stages cannot run sequence parallelism)."""
    from ..manager import _is_hugging_face

    out: dict[int, _Pipe] = {}
    if not pp_sizes:
        return out, False
    model = build(None)
    for pp in sorted(set(pp_sizes)):
        if batch % microbatches:
            skipped.append(f"pp={pp}: --batch {batch} does not split into {microbatches} micro-batches")
            continue
        problem = microbatch_problem(schedule, microbatches, pp, pp)
        if problem is not None:
            skipped.append(
                f"pp={pp}: {problem} (--fit gives each micro-batch one sequence of --batch {batch} unless "
                "--microbatches is given: raise --batch)"
            )
            continue
        try:
            shares = stage_shares(model, pp, schedule)
        except PlanningError as e:
            skipped.append(f"pp={pp}: {_short(e)}")
            continue
        out[pp] = _Pipe(shares, schedule, microbatches, batch, seq, None if policy is None else policy.param_dtype)
    return out, _is_hugging_face(model)


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


def _trace_mesh(tp: int, shards: int, replicated: bool, cp: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The fake mesh a reference step is traced on: ``shards`` FSDP ranks,
    ``cp`` and ``tp`` ranks, and a replicate dim of 2 for HSDP meshes (what
    HSDP adds, its all-reduce and the buffers it holds, does not depend on
    how many replicas there are)."""
    dims = [("dp_replicate", 2)] if replicated else []
    dims += [("dp_shard", shards)] + ([("cp", cp)] if cp > 1 else []) + ([("tp", tp)] if tp > 1 else [])
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)


def _trace_moe(
    tp: int, shards: int, replicated: bool, ep: int
) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """Under ``--ep``, the experts as units of their own on a MoE mesh of
    the same ranks without ``ep`` (whole experts, split by ``ep`` from shapes)."""
    if ep == 1:
        return None
    if replicated:
        return (2, shards * tp), ("dp_replicate", "ep_shard")
    return (shards * tp,), ("ep_shard",)


def _measure(
    build: Callable[[int | None], nn.Module],
    counts: Sequence[int | None],
    tp: int,
    points: Sequence[int],
    replicated: bool,
    setting: Any,
    ac: str | bool,
    batch_seq: tuple[int, int],
    ep: int,
    cp: int = 1,
) -> _Measured:
    """Trace the step of one setting at every block count and shard count."""
    from ._run import dry_run

    traced = []
    for n in counts:
        by_shards: dict[int, Trace] = {}
        shards_at = None
        for shards in points:
            model = build(n)
            if ac:
                disable_kv_cache(model)  # as the dry run and a training run with checkpointing do
            shape, names = _trace_mesh(tp, shards, replicated, cp)
            run = dry_run(model, shape, names, setting, batch_seq=batch_seq, moe=_trace_moe(tp, shards, replicated, ep))
            if run.trace is None:  # dry_run traces whenever batch_seq is given
                raise RuntimeError(f"no trace for tp={tp}, activation_checkpointing={ac!r}")
            by_shards[shards] = run.trace
            shards_at = shards_for(model, run.plan, run.dims, ep)  # the same plan at every shard count
        assert shards_at is not None  # points is never empty: every group has a mesh
        traced.append((n or 0, by_shards, shards_at))
    return _Measured(tuple(traced))
