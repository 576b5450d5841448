"""``python -m fsdptx plan --fit GPUSxMEMORY``: which parallelizations fit.

Every mesh the world allows (``pp`` x ``dp_replicate`` x ``dp_shard`` x
``cp`` x ``tp``, ``tp`` up to 8 and only where the model's TP plan divides;
``cp`` and ``pp`` from their searched sizes, :mod:`fsdptx.cli._fit_dims`),
activation checkpointing off / selective / full, and optimizer-state
offload off / on, each with its predicted per-rank peak and its
communication per step. For a model with experts each mesh also splits
them across each ``ep`` searched (``--ep``: :func:`auto_ep_sizes` by
default), ``ep`` of its shard x TP ranks (:attr:`Candidate.moe_mesh`). The
candidates are :mod:`fsdptx.cli._fit_candidate`'s, the traces they come
from :mod:`fsdptx.cli._fit_measure`'s.

Each candidate's peak (but a pipeline candidate's, which is modelled per
stage) is the one ``plan`` traces with the candidate's own options (tests
compare them), at a fraction of the traces:

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
  and ``TRACE_LAYERS`` blocks (more when its stack opens with blocks of
  another kind: :func:`trace_counts`) and the peak, activations and TP traffic
  extrapolated linearly: each further block adds one more block's
  activations, parameters and collectives. Fewer blocks: traced whole, exact.

The settings are traced independently of each other, in worker processes
(:mod:`fsdptx.cli._workers`, ``--fit-jobs``), and evaluated in a fixed order,
so the result does not depend on how many there are.

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
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core._tree import get_module_from_path
from ..model._index import discover_blocks
from ..plan._plan import Plan
from ._fit_candidate import AC_MODES, DEFAULT_HEADROOM, Candidate, FitResult, parse_fit, parse_headroom, rank
from ._fit_dims import cp_ring_bytes, evaluate_pipeline, pipes
from ._fit_measure import Measured, extrapolate, measure, ring_bytes, shard_points, shards_for, trace_mesh, trace_moe
from ._hardware import Hardware, predict, step_flops
from ._scaling import steady_bytes
from ._workers import run_tasks_alongside
from ._report import ParamShard, ceil_div, step_traffic

__all__ = [
    "DEFAULT_HEADROOM",
    "EP_SIZES",
    "MAX_TP",
    "TRACE_LAYERS",
    "Candidate",
    "FitResult",
    "auto_ep_sizes",
    "evaluate",
    "meshes",
    "parse_fit",
    "parse_headroom",
    "search",
]

TRACE_LAYERS = 3
"""Models with more blocks are traced at ``TRACE_LAYERS - 1`` and
``TRACE_LAYERS`` blocks and extrapolated."""

EP_SIZES = (2, 4, 8)
"""``--ep auto``: expert-parallel sizes tried besides 1 (those dividing the
expert counts): within one node, where the time model puts the experts'
all-to-alls (NVLink); larger ones are given as a list."""

MAX_TP = 8
"""Largest TP degree tried: TP collectives sit on the critical path of every
block, so beyond one node's GPUs (8 on common servers) it does not pay."""

def meshes(gpus: int, cp_sizes: Sequence[int] = (), pp_sizes: Sequence[int] = ()) -> list[dict[str, int]]:
    """Every ``pp x dp_replicate x dp_shard x cp x tp`` factorization of
    ``gpus`` (dims listed outermost first, as meshes are laid out) with
    ``tp <= MAX_TP``, ``cp`` in ``cp_sizes`` or 1, ``pp`` in ``pp_sizes`` or
    1, and at least two data-parallel ranks counting ``cp`` (FSDP
    shards over ``dp_shard x cp``; one rank has nothing to shard)."""
    out = []
    for pp in (1, *sorted(set(pp_sizes) - {1})):
        for cp in (1, *sorted(set(cp_sizes) - {1})):
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


def evaluate(
    mesh: dict[str, int],
    ac: str | bool,
    offload: bool,
    measured: Measured,
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
    for traced in measured.traces:
        ring = traced.ring(shard) if traced.ring(shard) is not None else ring
        target = (0, 0, 0) if offload else steady_bytes(traced.shards[(shard * cp, ep)], optimizer)
        peaks.append((traced.layers, traced.peak(shard, target)))
        acts.append((traced.layers, traced.activations(shard)))
        tp_comm.append((traced.layers, traced.collective_bytes(shard, "tp")))
    params, grads, states = steady_bytes(full_shards, optimizer)
    comm: dict[str, int] = {}
    # FSDP gathers a dense unit over the shard (x cp) ranks; under ep > 1 an
    # expert unit (planned whole) is split across ep first, so each rank
    # gathers its 1/ep of it over the MoE mesh's ep_shard ranks.
    groups = {"dp": (1, shard * cp), "moe": (ep, shard * tp // ep) if ep > 1 else (1, shard * cp)}
    gathered = {mesh: 0.0 for mesh in groups}
    reduced = {mesh: 0.0 for mesh in groups}
    for unit, traffic in zip(full_plan.units, step_traffic(full_plan)):
        share = _tp_local_share(unit.params, full_shards, tp) / groups[unit.mesh][0]
        gathered[unit.mesh] += traffic.all_gather_bytes * share
        reduced[unit.mesh] += traffic.reduce_scatter_bytes * share
    comm["fsdp_all_gather"] = sum(ring_bytes(gathered[m], n) for m, (_, n) in groups.items())
    comm["fsdp_reduce_scatter"] = sum(ring_bytes(reduced[m], n) for m, (_, n) in groups.items())
    grad_numel = sum(s.local_numel for s in full_shards.values() if s.requires_grad)
    comm["hsdp_all_reduce"] = ring_bytes(4 * grad_numel, rep, 2)  # fp32, the dry run's reduce dtype
    comm["tp"] = ring_bytes(extrapolate(tp_comm, layers), tp)
    if ring is not None:
        comm["cp_ring"] = cp_ring_bytes(ring, layers or len(ring.layers), ac)
    if offload:  # host links, not the network: at least one copy of each sharded part each way
        comm["offload_host_copies"] = params + grads
    return Candidate(
        mesh=mesh,
        activation_checkpointing=ac,
        offload=offload,
        peak_bytes=extrapolate(peaks, layers),
        activations_bytes=extrapolate(acts, layers),
        params_bytes=0 if offload else params,
        grads_bytes=0 if offload else grads,
        optimizer_bytes=0 if offload else states,
        comm_bytes=comm,
        extrapolated=len(measured.traces) > 1,
        ep=ep,
    )


def _tp_local_share(params: Sequence[str], shards: Mapping[str, ParamShard], tp: int) -> float:
    """The share of a unit's elements one TP rank holds, so gathers: FSDP
    shards each rank's TP shard (``numel / tp`` of a TP-split parameter, all
    of a replicated one), not the whole parameter the plan's unit counts."""
    known = [shards[f] for f in params if f in shards]
    whole = sum(s.numel for s in known)
    if whole == 0:
        return 1.0
    return sum(ceil_div(s.numel, tp) if s.tp_sharded else s.numel for s in known) / whole


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
    ep_sizes: Sequence[int] | None = (1,),
    cp_sizes: Sequence[int] = (),
    pp_sizes: Sequence[int] = (),
    schedules: Sequence[tuple[str, int]] = (("1F1B", 1),),
    microbatches: int | None = None,
    jobs: int = 1,
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
        flops_params: the parameters one token's matmuls multiply
            (:func:`fsdptx.cli._compute_params.compute_params`), for its
            FLOPs per token.
        headroom: bytes of ``budget`` left out of what a candidate may hold.
        ep_sizes: the expert-parallel sizes to try (1: experts in their
            blocks; ``N`` > 1: split across ``N`` ranks, on the MoE mesh
            :attr:`Candidate.moe_mesh`; ``None``: :func:`auto_ep_sizes`);
            a mesh whose shard x TP ranks an ``N`` does not divide is
            skipped for it (``auto`` tries no ``N`` above ``gpus``). The traces run with the experts whole (their
            forward needs the model's token dispatch), so gathered experts
            count whole: an upper bound. Every ``N`` > 1 shares one set of
            traces.
        cp_sizes: context-parallel sizes to try besides 1 (traced at
            ``seq / cp`` with ring attention modelled).
        pp_sizes: pipeline sizes to try besides 1 (modelled from the
            traces of the same mesh without stages: :mod:`fsdptx.cli._fit_dims`).
        schedules: the pipeline candidates' schedules, each with its
            stages per rank (1F1B and GPipe: 1; Interleaved1F1B: 2 or more).
        microbatches: their micro-batches per step (``None``: ``batch``,
            one sequence each).
        jobs: processes to trace the settings in (:mod:`fsdptx.cli._workers`);
            the result does not depend on it.

    Returns:
        A :class:`FitResult`.
    """
    from ._cp import cp_seq_error
    from ._run import dry_run

    counts = trace_counts(build(None), layers)
    candidates: list[Candidate] = []
    skipped: list[str] = []
    policy = config().mp_policy
    by_pp, hugging_face = pipes(
        build, pp_sizes, schedules, batch if microbatches is None else microbatches, batch, seq, policy, skipped
    )
    every = meshes(gpus, cp_sizes, tuple(by_pp))
    if ep_sizes is None:
        def planned() -> Plan:
            return dry_run(build(None), *trace_mesh(1, 2, False), config()).plan

        eps = tuple(e for e in auto_ep_sizes(build(None), planned) if e <= gpus)  # a model the dry run has not parallelized
    else:
        eps = tuple(sorted(set(ep_sizes)))
    wholes: dict[tuple[int, bool], tuple[list[int], int]] = {}  # (tp, experts split): their eps, where its refusal is listed
    settings: list[_Setting] = []  # what is traced, in the order candidates are listed
    tasks: list[Callable[[], Measured]] = []
    cost: list[int] = []
    for tp, cp in sorted({(m.get("tp", 1), m.get("cp", 1)) for m in every}):
        label = f"tp={tp}" + (f", cp={cp}" if cp > 1 else "")
        problem = cp_seq_error(seq, cp, tp, tp > 1) if cp > 1 else None
        if problem is None and seq % tp:
            problem = f"--seq {seq} is not divisible by {tp}; sequence parallelism splits every sequence over the TP ranks"
        if problem is not None:
            skipped.append(f"{label}: {problem}")
            continue
        tp_meshes = [m for m in every if (m.get("tp", 1), m.get("cp", 1)) == (tp, cp)]
        for moe in sorted({ep > 1 for ep in eps}):
            kind = [ep for ep in eps if (ep > 1) == moe]
            pairs = _with_ep(tp, tp_meshes, kind, hugging_face, skipped)
            if not pairs:
                continue
            wholes.setdefault((tp, moe), (kind, len(skipped)))
            for ac in AC_MODES:
                for replicated in (False, True):
                    group = tuple((m, ep) for m, ep in pairs if (m.get("dp_replicate", 1) > 1) == replicated)
                    if not group:
                        continue
                    settings.append(_Setting(tp, cp, ac, replicated, group, label))
                    points = shard_points(m["dp_shard"] for m, _ in group)
                    needed = {(m["dp_shard"] * k, ep) for m, ep in group for k in (1, cp)}
                    work = config(sequence_parallel=tp > 1, activation_checkpointing=ac)
                    ep_trace = max(ep for _, ep in group)  # every ep > 1 traces alike: experts whole, on their own mesh
                    tasks.append(
                        functools.partial(measure, build, counts, tp, points, replicated, work, ac, (batch, seq), ep_trace, cp, needed)
                    )
                    cost.append(len(points) * (3 if ac == "full" else 2 if ac else 1))
    # the traces are most of the time: largest first, so that no worker is left with one at the end
    order = sorted(range(len(tasks)), key=lambda i: -cost[i])

    def whole_models() -> dict[tuple[int, bool], _Whole | str]:
        return {key: _whole(build, key[0], kind, config) for key, (kind, _) in wholes.items()}

    every_measured, fulls = run_tasks_alongside(tasks, jobs, whole_models, order)
    # each refusal of a whole model is listed where the search met its tp (last first: the places hold)
    for key, (_, place) in reversed(wholes.items()):
        refused = fulls[key]
        if isinstance(refused, str):
            skipped.insert(place, f"tp={key[0]}: {refused}")
    for at, measured in zip(settings, every_measured):
        known = fulls[(at.tp, at.group[0][1] > 1)]
        if isinstance(known, str):  # the whole model's plan was refused (listed above): its traces do not count
            continue
        if isinstance(measured, ValueError):  # the planner or the model refuses this setting: the others still count
            skipped.append(f"{at.label}, ac={at.ac or 'off'}{', dp_replicate > 1' if at.replicated else ''}: {_short(measured)}")
            continue
        plan, full_at = known
        flops = step_flops(flops_params, batch * seq, at.ac) / (at.tp * at.cp)  # TP and CP split every matmul
        for mesh, ep in at.group:
            shards = full_at(mesh["dp_shard"] * at.cp, ep)
            pp = mesh.get("pp", 1)
            for pipe in by_pp[pp] if pp > 1 else (None,):
                try:
                    evaluated = [
                        evaluate(mesh, at.ac, offload, measured, shards, plan, layers or 0, optimizer, ep)
                        if pipe is None
                        else evaluate_pipeline(mesh, at.ac, offload, measured, shards, layers or 0, optimizer, pipe)
                        for offload in (False, True)
                    ]
                except ValueError as e:
                    skipped.append(f"--mesh {_mesh_text(mesh)} ac={at.ac or 'off'}: {_short(e)}")
                    continue
                # a pipeline rank computes its stages' blocks (the busiest rank sets the pace)
                # and idles (pp - 1) / (stages per rank x microbatches) of that in the bubble
                share = 1.0 if pipe is None else pipe.busiest_share
                bubble = 0.0 if pipe is None else pipe.bubble
                tokens = batch * seq / (at.tp * at.cp * pp)
                candidates += [
                    dataclasses.replace(
                        c, step=predict(c.mesh, c.comm_bytes, flops * share, hardware, tokens=tokens, bubble=bubble)
                    )
                    for c in evaluated
                ]
    return FitResult(
        gpus,
        budget,
        headroom,
        hardware,
        tuple(candidates),
        rank(candidates, budget - headroom),
        tuple(skipped),
        tuple(n or 0 for n in counts),
    )


def _with_ep(
    tp: int, tp_meshes: Sequence[dict[str, int]], eps: Sequence[int], hugging_face: bool, skipped: list[str]
) -> list[tuple[dict[str, int], int]]:
    """The (mesh, ep) candidates of one ``tp`` x ``cp``: ``ep`` must divide
    the mesh's shard x TP ranks (the experts' mesh regroups them), and a
    pipeline takes neither a MoE mesh nor, in a Hugging Face model, TP
    (its stages run TP without sequence parallelism, which is not traced).
    What is left out is said in ``skipped``."""
    pairs = []
    for ep in eps:
        for m in tp_meshes:
            if (m["dp_shard"] * tp) % ep:
                skipped.append(f"--mesh {_mesh_text(m)}: ep={ep} does not divide its dp_shard x tp ranks")
            elif m.get("pp", 1) == 1:
                pairs.append((m, ep))
        staged = [m for m in tp_meshes if m.get("pp", 1) > 1 and (m["dp_shard"] * tp) % ep == 0]
        if staged and ep > 1:
            skipped.append(f"tp={tp} with pp: the dry run plans no pipeline with a MoE mesh (ep={ep})")
        elif staged and hugging_face and tp > 1:
            skipped.append(
                f"tp={tp} with pp: a Hugging Face model's pipeline stages run TP without sequence parallelism, "
                "which --fit does not trace"
            )
        else:
            pairs += [(m, ep) for m in staged]
    return pairs


_Whole = tuple[Plan, Callable[[int, int], dict[str, ParamShard]]]


def _whole(build: Callable[[int | None], nn.Module], tp: int, eps: Sequence[int], config: Callable[..., Any]) -> _Whole | str:
    """The whole model's plan at ``tp`` (experts on their own mesh when the
    ``eps`` split them) and its exact shards at any shard count for each
    of ``eps``; why not, when the planner refuses it (a TP plan or an
    ``ep`` that does not divide)."""
    from ._run import dry_run

    model = build(None)
    try:
        full = dry_run(model, *trace_mesh(tp, 2, False), config(sequence_parallel=tp > 1), moe=trace_moe(tp, 2, False, max(eps)))
        by_ep = {ep: shards_for(model, full.plan, full.dims, ep) for ep in eps}
    except ValueError as e:
        return _short(e)
    return full.plan, lambda shards, ep: by_ep[ep](shards)


def auto_ep_sizes(model: nn.Module, plan: Callable[[], Plan]) -> tuple[int, ...]:
    """``--ep auto``: 1, and each of :data:`EP_SIZES` that divides every
    expert count of ``model`` (its experts as the manager finds them:
    declared, else transformers' plans; ``plan`` plans the model, called
    only when it has some); a model without experts: 1 alone."""
    from ..hf._declarations import expert_modules_of
    from ..model._index import PlanningError
    from ..plan.transforms import expert_parallel

    globs = expert_modules_of(model)
    if not globs:
        return (1,)
    try:
        split = expert_parallel(model, plan(), expert_modules=globs).expert_parallel
    except PlanningError:
        return (1,)
    counts = () if split is None else split.num_experts
    return (1, *(s for s in EP_SIZES if counts and all(n % s == 0 for n in counts)))


@dataclass(frozen=True)
class _Setting:
    """One traced setting of the search and the meshes its traces stand for."""

    tp: int
    cp: int
    ac: str | bool
    replicated: bool
    group: tuple[tuple[dict[str, int], int], ...]  # (mesh, ep)
    label: str


def trace_counts(model: nn.Module, layers: int | None) -> tuple[int | None, ...]:
    """The block counts the search traces ``model`` at: all of them when it
    has at most :data:`TRACE_LAYERS` (or they cannot be changed), else two
    counts whose models end in one and two blocks of the stack's repeating
    kind. A stack that opens with blocks of another kind (DeepSeek-V3's
    dense layers before its MoE ones) keeps them all in both, so the
    difference of the two traces is one block of the kind the rest repeats."""
    if layers is None or layers <= TRACE_LAYERS:
        return (layers,)
    blocks = [get_module_from_path(model, fqn) for fqn in discover_blocks(model)]

    def kind(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((name, tuple(p.shape)) for name, p in block.named_parameters())

    last = kind(blocks[-1]) if blocks else ()
    first = next((i for i, b in enumerate(blocks) if all(kind(x) == last for x in blocks[i:])), 0)
    lead = max(first + 2, TRACE_LAYERS)
    return (lead - 1, lead) if lead < layers else (layers,)


def _mesh_text(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]


