"""``plan --fit`` beyond ``dp x tp``: context parallelism and pipeline stages.

Context parallelism is traced like every other candidate (the dry run
traces a ``cp`` step at ``seq / cp`` and models ring attention's buffers,
:mod:`fsdptx.cli._cp`); this module adds only its ring traffic, from the
same attention layers the buffers come from.

Pipeline candidates are *modelled* from the traces the search already
made, not traced per stage (a stage trace per candidate would cost what the
whole search costs). The traced steps at two block counts give what one
block adds (its activations) and what the rest of the step holds; each
stage of the split ``plan`` would make (:func:`stage_shares`, the planner's
own split) then holds, per rank:

- its parameters, gradients and optimizer state, exact from the shapes;
- its units gathered for the whole step (under pipeline parallelism FSDP
  keeps parameters gathered between forward and backward), and all of
  their unsharded gradients in the reduce dtype, accumulated over the
  micro-batches until the one reduce-scatter after the last;
- its blocks' activations for the micro-batches in flight
  (:func:`~fsdptx.plan._stages.in_flight_microbatches`), each micro-batch
  ``batch / microbatches`` sequences; the last stage also the rest of the
  traced step's (what the loss saves) and its output, the logits, which
  the schedule keeps until the micro-batch's backward (the traced step
  drops them once the loss has them); a stage that runs every forward
  before its first backward holds all of them before any gradient
  exists, and one micro-batch fewer once all do;
- transients scaled to one micro-batch: on the last stage the largest
  temporaries the traced step holds (the loss's, over the vocabulary), on
  the others the largest while a unit below the root runs (a block's: the
  loss runs in the root's); and the collective buffers (one unit's) of
  its peak as traced;
- the point-to-point buffers of every micro-batch's input and gradient.

The loss's fp32 logits and their gradient are in the traced step's
activations and temporaries already; counting them again on the last
stage (as this model once did) put 1F1B candidates at 2,048 tokens 30% to
38% above the traced stages.

The peak stage is the candidate's peak. Tests compare it with ``plan``
run with the candidate's options (a traced step per stage).

With a ``cp`` dim as well, the traces are the ``cp`` step's (``seq / cp``
tokens per rank, ring buffers modelled): a stage's blocks, its boundary
tensors and its head's logits hold its CP rank's tokens, ring attention's
buffers count with the transients of one micro-batch, its traffic over
the busiest rank's blocks, and FSDP's collectives run over
``dp_shard x cp`` ranks, as ``plan`` applies such a pipeline.

Interleaved 1F1B puts several stages on each rank (rank ``r`` holds
``r``, ``r + pp``, ...): a rank's parameters, gradients, gathered units
and buffers are the sum over its stages, its activations the most held at
once as the rank runs its forwards and backwards in torch's own order
(:func:`~fsdptx.plan._stages.interleaved_1f1b_actions`, :func:`most_held`):
the stages peak at different moments, so the sum of their maxima would
overstate it. The dry run traces one stage per rank, so tests compare
these candidates with a plain tracker run of each rank's stages in that
order, and their exact parts with ``plan``'s per-rank figures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..model._index import ModelIndex, PlanningError, discover_blocks
from ..model._stages import pipeline_parts
from ..plan._stages import (
    PipelineParallelConfig,
    bubble_fraction,
    in_flight_microbatches,
    interleaved_1f1b_actions,
    microbatch_problem,
    split_stages,
)
from ._common import _one_line
from ._fit_candidate import Candidate
from ._fit_measure import Measured, extrapolate, ring_bytes
from ._report import ParamShard, ceil_div
from ._ring import GRAD_BYTES, RingAttention
from ._scaling import rescale, steady_bytes, traced_steady
from ._trace import RING_BUFFERS, token_embedding

__all__ = [
    "CP_MIN_SEQ",
    "CP_SIZES",
    "FIT_SCHEDULES",
    "INTERLEAVED_STAGES",
    "PP_SIZES",
    "Pipe",
    "StagePeak",
    "StageShares",
    "cp_ring_bytes",
    "most_held",
    "p2p_bytes",
    "evaluate_pipeline",
    "parse_ep",
    "parse_sizes",
    "pipeline_peak",
    "pipes",
    "stage_shares",
]

CP_SIZES = (2, 4, 8)
CP_MIN_SEQ = 16384
"""``--fit-cp auto`` searches ``cp`` in :data:`CP_SIZES` from this sequence
length on: below it a sequence's activations rarely outgrow what FSDP and
TP leave free, and every ``cp`` size costs the search as much as ``cp=1``."""

PP_SIZES = (2, 4, 8, 16)
"""``--fit-pp auto``: pipeline sizes tried (those that divide the world and
leave each stage a block)."""

FIT_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""Schedules ``--fit`` models: one stage per rank, and interleaved 1F1B
with ``--stages-per-rank`` stages per rank (default
:data:`INTERLEAVED_STAGES`)."""

INTERLEAVED_STAGES = 2
"""Stages per rank of ``--fit``'s interleaved candidates unless
``--stages-per-rank`` says otherwise: the smallest that interleaves."""


def parse_sizes(text: str, option: str, auto: Sequence[int]) -> tuple[int, ...]:
    """``--fit-cp``/``--fit-pp``: ``auto`` (``auto``'s sizes), ``1`` (none)
    or a comma list such as ``2,4``; sizes above 1 only.

    Raises:
        ValueError: naming the option and the text.
    """
    if text.strip() == "auto":
        return tuple(auto)
    return tuple(s for s in _sizes(text, option, "1 or sizes such as 2,4") if s > 1)


def parse_ep(text: str) -> tuple[int, ...] | None:
    """``--ep`` under ``--fit``: ``auto`` (``None``: the search picks from
    the model's expert counts) or the sizes to try, 1 included if given.

    Raises:
        ValueError: naming the option and the text.
    """
    if text.strip() == "auto":
        return None
    return _sizes(text, "--ep", "a size such as 8 or sizes such as 1,8")


def _sizes(text: str, option: str, expected: str) -> tuple[int, ...]:
    """The sorted distinct sizes of a comma list, each at least 1."""
    try:
        sizes = tuple(sorted({int(t) for t in text.split(",")}))
    except ValueError:
        raise ValueError(f"malformed {option} {text!r}: expected auto, {expected}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{option} {text!r}: sizes must be integers >= 1")
    return sizes


def cp_ring_bytes(ring: RingAttention, layers: int, ac: str | bool) -> int:
    """Bytes one CP rank receives per step for ring attention over ``layers``
    attention layers: K and V of the rest of the sequence gathered in
    forward, again in backward and in a full recompute, and the fp32 dK/dV
    chunks passed around the ring in backward (``(cp - 1) / cp`` of each)."""
    if ring.cp < 2 or not ring.layers:
        return 0
    widest = max(ring.layers, key=lambda layer: layer.kv_bytes_per_token)
    gathers = 2 + (1 if ac == "full" else 0)
    per_layer = ring.batch * ring.seq * (gathers * widest.kv_bytes_per_token + widest.kv_width * GRAD_BYTES)
    return int(layers * per_layer * (ring.cp - 1) / ring.cp)


@dataclass(frozen=True)
class StageShares:
    """The whole model split into ``pp`` stages as the planner splits it:
    blocks per stage and the parameters (FQNs) each stage holds."""

    blocks: tuple[int, ...]
    params: tuple[tuple[str, ...], ...]
    hidden: int | None  # the stream's width between stages (None: not found)
    vocab: int | None  # the head's output width (None: not found)


def most_held(actions: Sequence[tuple[str, int, int]], per_microbatch: Mapping[int, float]) -> float:
    """The most activations a rank holds at once when it runs ``actions``
    (``(kind, stage, micro-batch)`` in order): each forward adds one
    micro-batch's activations of its stage (``per_microbatch``), kept until
    that micro-batch's backward on the same stage."""
    held = most = 0.0
    for kind, stage, _ in actions:
        held += per_microbatch[stage] if kind == "F" else -per_microbatch[stage]
        most = max(most, held)
    return most


def stage_shares(model: nn.Module, pp: int, schedule: str, stages_per_rank: int = 1) -> StageShares:
    """The stages of ``model`` (unparallelized, meta is fine) on ``pp``
    ranks, ``stages_per_rank`` each (rank ``r`` holds stages ``r``, ``r + pp``, ...).

    Raises:
        PlanningError: the model cannot be split into ``pp`` stages.
    """
    index = ModelIndex.build(model)
    parts = pipeline_parts(model, index, discover_blocks(model, index))
    split = split_stages(parts, PipelineParallelConfig(schedule=schedule, stages_per_rank=stages_per_rank), pp)
    owner = {fqn: s for s, held in enumerate(split) for fqn in held}
    params: list[list[str]] = [[] for _ in split]
    for name, _ in model.named_parameters():
        parts_of = name.split(".")
        stage = next((owner[".".join(parts_of[:i])] for i in range(len(parts_of), 0, -1) if ".".join(parts_of[:i]) in owner), None)
        if stage is not None:
            params[stage].append(name)
    block_set = set(parts.blocks)
    embedding = token_embedding(model)
    hidden = None if embedding is None else embedding.embedding_dim
    vocab = None if embedding is None else embedding.num_embeddings
    return StageShares(
        blocks=tuple(sum(1 for f in held if f in block_set) for held in split),
        params=tuple(tuple(p) for p in params),
        hidden=hidden,
        vocab=vocab,
    )


@dataclass(frozen=True)
class StagePeak:
    """One pipeline candidate's modelled peak rank (its stage, with one
    per rank) and its traffic inputs, per pp rank."""

    peak_bytes: int
    stage: int  # the peak pp rank; with one stage per rank also its stage
    activations_bytes: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    gathered_bytes: tuple[int, ...]  # per pp rank: its stages' units gathered (compute dtype)
    grad_numel: tuple[int, ...]  # per pp rank: this TP rank's gradient elements
    most_blocks: int  # the most blocks one pp rank runs
    bubble: float


def _tp_local(shard: ParamShard, tp: int) -> int:
    return ceil_div(shard.numel, tp) if shard.tp_sharded else shard.numel


def pipeline_peak(
    shares: StageShares,
    shards: Mapping[str, ParamShard],
    *,
    schedule: str,
    microbatches: int,
    tp: int,
    block_activations: float,
    rest_activations: float,
    token_transient: int,
    block_transient: int,
    unit_transient: int,
    batch: int,
    seq: int,
    sequence_parallel: bool,
    compute_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    optimizer: str,
    offload: bool,
    stages_per_rank: int = 1,
) -> StagePeak:
    """The modelled peak of every pp rank, the sum over its stages (module
    docstring); the largest one is returned with what it is made of.

    Args:
        shares: the split (:func:`stage_shares`).
        shards: rank 0's shard of every parameter at the candidate's mesh.
        block_activations: one block's activations at the whole ``batch``.
        rest_activations: the traced step's activations outside the blocks.
        token_transient: the traced step's largest temporaries at the whole
            ``batch`` (the loss's, over the vocabulary): the last stage's.
        block_transient: the largest while a unit below the root runs (a
            block's; the loss runs in the root's): every other stage's.
        unit_transient: the traced peak's collective buffers (one unit's).
        compute_dtype: the units' compute dtype (``None``: storage dtype).
        reduce_dtype: the dtype their gradients accumulate and reduce in
            (``None``: storage dtype).

    Raises:
        ValueError: the schedule cannot run ``microbatches`` on these stages.
    """
    stages = len(shares.blocks)
    pp = stages // stages_per_rank
    problem = microbatch_problem(schedule, microbatches, stages, pp)
    if problem is not None:
        raise ValueError(problem)
    act_bytes = (compute_dtype or torch.bfloat16).itemsize
    stream = 0
    if shares.hidden is not None:
        local_seq = seq // tp if sequence_parallel and tp > 1 else seq
        stream = batch * local_seq * shares.hidden * act_bytes  # every micro-batch's boundary tensor, together
    # the head's output for the whole batch, the whole vocabulary on every TP rank (a TP plan may
    # return it replicated; with loss_parallel it is a shard, and this errs high)
    output = 0 if shares.vocab is None else batch * seq * shares.vocab * act_bytes
    best: tuple[int, int, int, tuple[int, int, int]] | None = None
    gathered: list[int] = []
    grad_numel: list[int] = []
    blocks: list[int] = []
    for rank in range(pp):
        held_stages = range(rank, stages, pp)  # loop placement
        mine = {f: shards[f] for s in held_stages for f in shares.params[s] if f in shards}
        steady = (0, 0, 0) if offload else steady_bytes(mine, optimizer)
        held = sum(_tp_local(p, tp) * (compute_dtype or p.dtype).itemsize for p in mine.values())
        # every unit's unsharded gradients accumulate over the micro-batches until the one reduce-scatter
        accumulated = sum(_tp_local(p, tp) * (reduce_dtype or p.dtype).itemsize for p in mine.values() if p.requires_grad)
        gathered.append(held)
        grad_numel.append(sum(_tp_local(p, tp) for p in mine.values() if p.requires_grad))
        blocks.append(sum(shares.blocks[s] for s in held_stages))
        # one micro-batch's activations on each of the rank's stages; the last one's also its
        # output, which the schedule keeps until that micro-batch's backward (the traced step drops
        # the logits once the loss has them)
        per_microbatch = {
            s: (shares.blocks[s] * block_activations + (rest_activations + output if s == stages - 1 else 0)) / microbatches
            for s in held_stages
        }
        # with its gradients: what is still held once the first backward has made them all
        acts_with_grads = None
        if stages_per_rank == 1:
            flight = in_flight_microbatches(schedule, rank, stages, microbatches)
            acts = flight * per_microbatch[rank]
            if flight == microbatches:  # every forward before the first backward: none runs after it
                acts_with_grads = (microbatches - 1) * per_microbatch[rank]
        else:
            acts = most_held(interleaved_1f1b_actions(rank, pp, stages_per_rank, microbatches), per_microbatch)
        p2p = 0.0
        for s in held_stages:
            p2p += 2 * stream if 0 < s < stages - 1 else stream  # inputs and their gradients; an end stage one side
        # the step's sharded gradients only come from the reduce-scatter after the last backward,
        # when the activations, transients and in-flight buffers of the micro-batches are gone
        params, grads, states = steady
        # the loss's temporaries (the largest, over the vocabulary) only where the loss is computed
        transient = token_transient if stages - 1 in held_stages else block_transient
        others = transient / microbatches + unit_transient + p2p
        if acts_with_grads is None:
            during = acts + others + accumulated
        else:  # the activations peak before the gradients exist, and one micro-batch's are gone once they all do
            during = max(acts, acts_with_grads + accumulated) + others
        peak = int(params + states + held + max(during, accumulated + grads))
        if best is None or peak > best[0]:
            best = (peak, rank, int(acts), steady)
    assert best is not None  # a split has at least one stage
    peak, stage, acts, (params, grads, states) = best
    return StagePeak(
        peak_bytes=peak,
        stage=stage,
        activations_bytes=acts,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=states,
        gathered_bytes=tuple(gathered),
        grad_numel=tuple(grad_numel),
        most_blocks=max(blocks),
        bubble=bubble_fraction(pp, microbatches, stages_per_rank),
    )


def p2p_bytes(shares: StageShares, *, batch: int, seq: int, tp: int, sequence_parallel: bool, dtype: torch.dtype | None) -> int:
    """Bytes a middle stage sends and receives per step: every micro-batch's
    activation in and out in forward, and their gradients in backward."""
    if shares.hidden is None:
        return 0
    local_seq = seq // tp if sequence_parallel and tp > 1 else seq
    return 4 * batch * local_seq * shares.hidden * (dtype or torch.bfloat16).itemsize


def evaluate_pipeline(
    mesh: dict[str, int],
    ac: str | bool,
    offload: bool,
    measured: Measured,
    shards: dict[str, ParamShard],
    layers: int,
    optimizer: str,
    pipe: Pipe,
) -> Candidate:
    """Model one pipeline candidate (:mod:`fsdptx.cli._fit_dims`) from the
    traces of its (tp, checkpointing, replication) at its shard count:
    the activations one block adds, the rest, and the step's transient
    peak, then each stage of the planner's split.

    Raises:
        ValueError: the schedule cannot run the micro-batches on these stages."""
    shard, rep, tp, cp = mesh["dp_shard"], mesh.get("dp_replicate", 1), mesh.get("tp", 1), mesh.get("cp", 1)
    acts: list[tuple[int, float]] = []
    by_tokens = by_block = by_params = 0
    tp_comm: list[tuple[int, float]] = []
    ring = None
    for traced in measured.traces:
        trace = traced.trace(shard)
        ring = trace.ring or ring
        target = steady_bytes(traced.shards[(shard * cp, 1)], optimizer)
        _, _, at_peak = rescale(trace, traced=traced_steady(trace), target=target)
        # transients: the operators' temporaries and inputs grow with the tokens (the largest the
        # step holds: a stage may peak where the whole model does not, at its head), so do ring
        # attention's buffers; the buffers of a unit's collectives grow with its parameters
        # (one unit's, as at the peak)
        by_tokens = max(by_tokens, max((sum(x.bytes.get(k, 0) for k in TOKEN_TRANSIENTS) for x in trace.samples), default=0))
        by_block = max(
            by_block,
            max((sum(x.bytes.get(k, 0) for k in TOKEN_TRANSIENTS) for x in trace.samples if x.unit != ""), default=0),
        )
        by_params = max(by_params, sum(at_peak.get(k, 0) for k in UNIT_TRANSIENTS))
        acts.append((traced.layers, trace.activations))
        tp_comm.append((traced.layers, sum(c.bytes for c in trace.collectives if c.source == "tp")))
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
        block_transient=by_block,
        unit_transient=by_params,
        batch=pipe.batch,
        seq=pipe.seq // cp,  # a CP rank's stage receives, runs and sends its own tokens
        sequence_parallel=tp > 1,
        compute_dtype=pipe.compute_dtype,
        reduce_dtype=pipe.reduce_dtype,
        optimizer=optimizer,
        offload=offload,
        stages_per_rank=pipe.stages_per_rank,
    )
    busiest = found.gathered_bytes.index(max(found.gathered_bytes))
    grad_numel = found.grad_numel[busiest]
    comm = {
        "fsdp_all_gather": ring_bytes(found.gathered_bytes[busiest], shard * cp),  # gathered once: no reshard under PP
        "fsdp_reduce_scatter": ring_bytes(4 * grad_numel, shard * cp),  # fp32, once per step
        "hsdp_all_reduce": ring_bytes(4 * grad_numel, rep, 2),
        "tp": ring_bytes(extrapolate(tp_comm, layers) * found.most_blocks / total, tp),
        "pp_p2p": pipe.stages_per_rank  # each of the rank's stages passes its boundary on
        * p2p_bytes(pipe.shares, batch=pipe.batch, seq=pipe.seq // cp, tp=tp, sequence_parallel=tp > 1, dtype=pipe.compute_dtype),
    }
    if ring is not None:  # the busiest rank's attention layers, one per block
        comm["cp_ring"] = cp_ring_bytes(ring, found.most_blocks, ac)
    if offload:
        mine = [f for s in range(busiest, len(pipe.shares.params), len(found.gathered_bytes)) for f in pipe.shares.params[s]]
        held = steady_bytes({f: shards[f] for f in mine if f in shards}, optimizer)
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
        stages_per_rank=pipe.stages_per_rank,
    )


UNIT_TRANSIENTS = ("all_gather_buffers", "reduce_scatter_buffers")
TOKEN_TRANSIENTS = ("temporaries", "inputs", RING_BUFFERS)


@dataclass(frozen=True)
class Pipe:
    """What every pipeline candidate of one size shares: the split, the
    schedule and its micro-batches, the step's batch and sequence, and the
    units' compute and reduce dtypes."""

    shares: StageShares
    schedule: str
    microbatches: int
    batch: int
    seq: int
    compute_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    stages_per_rank: int = 1

    @property
    def busiest_share(self) -> float:
        """The share of the blocks the busiest pp rank runs (its stages' together)."""
        stages = len(self.shares.blocks)
        pp = stages // self.stages_per_rank
        most = max(sum(self.shares.blocks[s] for s in range(r, stages, pp)) for r in range(pp))
        return most / sum(self.shares.blocks)

    @property
    def bubble(self) -> float:
        """The idle share of a rank's step, as :mod:`fsdptx.cli._hardware` takes it: ``(pp - 1) / (v m)``."""
        pp = len(self.shares.blocks) // self.stages_per_rank
        return (pp - 1) / (self.stages_per_rank * self.microbatches)


def pipes(
    build: Callable[[int | None], nn.Module],
    pp_sizes: Sequence[int],
    schedules: Sequence[tuple[str, int]],
    microbatches: int,
    batch: int,
    seq: int,
    policy: Any,
    skipped: list[str],
) -> tuple[dict[int, tuple[Pipe, ...]], bool]:
    """The split of the whole model for each pipeline size and (schedule,
    stages per rank) that can run (the others listed in ``skipped`` with
    why), and whether the model is a Hugging Face one (its stages cannot
    run sequence parallelism)."""
    from ..manager import _is_hugging_face

    out: dict[int, tuple[Pipe, ...]] = {}
    if not pp_sizes:
        return out, False
    model = build(None)
    for pp in sorted(set(pp_sizes)):
        if batch % microbatches:
            skipped.append(f"pp={pp}: --batch {batch} does not split into {microbatches} micro-batches")
            continue
        found: list[Pipe] = []
        for schedule, per_rank in schedules:
            label = f"pp={pp}" + (f", {schedule} x {per_rank} stages per rank" if per_rank > 1 else f", {schedule}")
            problem = microbatch_problem(schedule, microbatches, pp * per_rank, pp)
            if problem is None and per_rank > 1 and microbatches < pp:
                # torch runs it, but with fewer micro-batches than ranks nothing overlaps: the
                # bubble is (pp - 1) of the work whatever the interleaving, not (pp - 1) / (v m)
                problem = f"{schedule} interleaves nothing with {microbatches} micro-batches on {pp} ranks"
            if problem is not None:
                skipped.append(
                    f"{label}: {problem} (--fit gives each micro-batch one sequence of --batch {batch} unless "
                    "--microbatches is given: raise --batch)"
                )
                continue
            try:
                shares = stage_shares(model, pp, schedule, per_rank)
            except PlanningError as e:
                skipped.append(f"{label}: {_one_line(e)}")
                continue
            compute, reduce = (None, None) if policy is None else (policy.param_dtype, policy.reduce_dtype)
            found.append(Pipe(shares, schedule, microbatches, batch, seq, compute, reduce, per_rank))
        if found:
            out[pp] = tuple(found)
    return out, _is_hugging_face(model)
