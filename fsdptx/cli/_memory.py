"""The memory of one training step: :func:`estimate_memory` from Python,
and the traced figures of the dry run's report.

The shape-only :func:`fsdptx.cli._report.memory_plan` is exact for
parameters, gradients and optimizer state but cannot know what a forward
saves. :func:`estimate_memory` plans and parallelizes the model on a fake
mesh, traces one real training step (:mod:`fsdptx.cli._trace`) and
combines it with the exact shard sizes (:mod:`fsdptx.cli._scaling`) into a
:class:`MemoryEstimate`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..apply._checkpoint import turn_kv_cache_off
from ..core._args import require_module, require_positive_int
from ..core._meshes import ep_size
from ._ep import ExpertRouting, StaticDispatch, check_routing_skew, static_dispatch_problems
from ._cp import ROTATE_METHODS, attention_projections, cp_seq_error, no_attention_error, ring_attention, with_ring_buffers
from ._ring import RingAttention
from ._report import OPTIMIZER_STATES, ParamShard
from ._scaling import rescale, steady_bytes, traced_steady
from ._trace import Collective, Sample, Trace, trace_step, vocab_size, where_label

__all__ = ["MemoryEstimate", "estimate_memory"]

@dataclass(frozen=True)
class MemoryEstimate:
    """What one rank holds over one training step, in bytes.

    ``params_bytes``, ``grads_bytes`` and ``optimizer_bytes`` are the exact
    shard sizes (padding included); ``activations_bytes`` is what forward
    left saved for backward (plus the loss and logits) when backward starts;
    ``peak_bytes`` is the largest total of the whole step with
    ``peak_breakdown`` the categories at that moment and ``peak_at`` its
    unit and phase. ``timeline`` and ``collectives`` are the traced step;
    ``notes`` lists every figure that is estimated instead of traced.
    With a ``cp`` dim > 1 the step is traced at ``seq / cp`` tokens and
    ``context_parallel`` holds ring attention's modelled buffers, which
    the timeline and the peak include (:mod:`fsdptx.cli._cp`). With an
    ``ep`` dim > 1 the experts' token dispatch runs at sizes fixed by a
    routing assumption, which ``expert_routing`` states (:mod:`fsdptx.cli._ep`).

    Attributes:
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        params_bytes: the parameter shard.
        grads_bytes: the gradient shard.
        optimizer_bytes: the optimizer state.
        activations_bytes: saved for backward when backward starts.
        peak_bytes: the step's largest total.
        peak_at: where the peak is (unit and phase).
        peak_breakdown: the categories at the peak.
        timeline: the traced step.
        collectives: the traced collectives.
        notes: the figures that are estimated instead of traced.
        context_parallel: ring attention's modelled buffers (None without cp).
        expert_routing: the routing the experts' dispatch assumed (None without ep).

    Example::

        estimate = fsdptx.estimate_memory(manager, model, batch=1, seq=4096)
        print(estimate.peak_bytes, estimate.peak_at)
    """

    batch: int
    seq: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    peak_bytes: int
    peak_at: str
    peak_breakdown: Mapping[str, int]
    timeline: tuple[Sample, ...] = ()
    collectives: tuple[Collective, ...] = ()
    notes: tuple[str, ...] = field(default=())
    context_parallel: RingAttention | None = None
    expert_routing: ExpertRouting | None = None

    def to_json(self) -> dict[str, Any]:
        """The figures as JSON-ready data (the timeline is left to ``--html``)."""
        return {
            "batch": self.batch,
            "seq": self.seq,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_at": self.peak_at,
            "peak_breakdown": dict(self.peak_breakdown),
            "collective_bytes": collective_bytes(self.collectives),
            "estimated": list(self.notes),
            "context_parallel": None if self.context_parallel is None else self.context_parallel.to_json(),
            "expert_parallel": None if self.expert_routing is None else self.expert_routing.to_json(),
        }


def collective_bytes(collectives: Sequence[Collective]) -> dict[str, int]:
    """Bytes per ``source/op`` (e.g. ``fsdp/all_gather``), summed over the step."""
    out: dict[str, int] = {}
    for c in collectives:
        key = f"{c.source}/{c.op}"
        out[key] = out.get(key, 0) + c.bytes
    return dict(sorted(out.items()))


def estimate_from_trace(
    trace: Trace,
    shards: Mapping[str, ParamShard],
    *,
    batch: int,
    seq: int,
    optimizer: str,
    notes: Sequence[str] = (),
    offload: bool = False,
) -> MemoryEstimate:
    """Combine a trace with the exact shard sizes of ``shards``.

    The trace's AdamW state stands for ``optimizer``'s (``sgd``: one state
    per element, ``none``: none), by scaling; parameters and gradients are
    the traced ones scaled to the exact totals (equal when ``shards`` is
    what was traced). With ``offload`` (FSDP2's ``CPUOffloadPolicy``) the
    sharded parts live on the host: the device peak leaves them out, and a
    note says so (the fake mesh is a CPU mesh, so the trace cannot tell)."""
    traced = traced_steady(trace)
    params, grads, states = steady_bytes(shards, optimizer)
    target = (0, 0, 0) if offload else (params, grads, states)
    peak, i, breakdown = rescale(trace, traced=traced, target=target)
    if offload:
        notes = (
            *notes,
            "offload: traced without CPUOffloadPolicy (FakeTensorMode cannot pin host memory); the sharded "
            "parameters, gradients and optimizer state it keeps on the host are left out of the peak",
        )
    sample = trace.samples[i]
    notes = (*trace.notes, *notes)
    return MemoryEstimate(
        batch=batch,
        seq=seq,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=states,
        activations_bytes=trace.activations,
        peak_bytes=peak,
        peak_at=where_label(sample),
        peak_breakdown=breakdown,
        timeline=trace.samples,
        collectives=trace.collectives,
        notes=tuple(notes),
        context_parallel=trace.ring,
        expert_routing=trace.routing,
    )



def estimate_memory(
    manager: Any,
    model: nn.Module,
    *,
    batch: int = 1,
    seq: int = 2048,
    optimizer: str = "adamw",
    cp_rotate: str = "allgather",
    routing_skew: float = 1.0,
) -> MemoryEstimate:
    """The per-rank memory of one training step of ``model`` under ``manager``.

    Plans and parallelizes ``model`` (built on the meta device) with
    ``manager`` on its mesh, which must be a fake mesh
    (:func:`fsdptx.testing.fake_mesh`), then traces forward, backward and
    the optimizer step under ``FakeTensorMode`` (see
    :mod:`fsdptx.cli._trace`). Nothing is allocated; ``model`` is consumed
    (its tensors become fake) once the arguments pass their checks, which
    all come first: a refused call leaves ``model`` as it was.

    Args:
        manager: the :class:`fsdptx.FSDP2Manager` whose plan to size.
        model: the model on the meta device.
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        optimizer: ``adamw`` (2 states in the parameters' storage dtype), ``sgd`` (1) or ``none``.
        cp_rotate: how ring attention rotates K/V with a ``cp`` dim > 1,
            as torch's ``set_rotate_method``: ``allgather`` (its default)
            or ``alltoall``. A CP step is traced at ``seq / cp`` tokens and
            the rotation's buffers are modelled (see :mod:`fsdptx.cli._cp`).
        routing_skew: with a ``moe_mesh`` that splits experts across
            ``ep`` > 1 ranks, the routing the experts' token dispatch is
            traced under: 1 (balanced, each expert receives
            ``ep x tokens x top_k / num_experts`` rows) or ``F`` > 1, the
            busiest expert receiving ``F`` times that, on every expert of
            the traced rank (see :mod:`fsdptx.cli._ep`).

    Returns:
        A :class:`MemoryEstimate` for rank 0.

    Raises:
        TypeError: ``manager`` is not an ``FSDP2Manager``, ``model`` not a
            module or has no token embedding, ``batch`` or ``seq`` not an
            int, ``routing_skew`` not a number.
        ValueError: ``batch`` or ``seq`` is below 1, ``optimizer`` unknown,
            ``model`` not on the meta device, ``seq`` not divisible by the TP
            size under sequence parallelism, ``cp_rotate`` unknown, with
            ``cp`` > 1 ``seq`` not divisible by ``2 x cp`` (``2 x cp x tp``
            under sequence parallelism) or a model without attention
            layers to model, ``routing_skew`` below 1 or not finite, or
            other than 1 without ``ep`` > 1, a manager that plans pipeline
            stages (:func:`fsdptx.estimate_pipeline_memory` sizes those),
            experts split across ``ep`` > 1 that are not transformers'
            fused experts modules (whose dispatch the trace stands in for),
            or a plan with no FSDP unit to track.

    Example::

        with fsdptx.testing.fake_mesh((8,), ("dp",)) as mesh, torch.device("meta"):
            model = build_model()
            estimate = fsdptx.estimate_memory(fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh), model)
    """
    from ..manager import FSDP2Manager
    from ._common import param_shards

    where = "estimate_memory"
    if not isinstance(manager, FSDP2Manager):
        raise TypeError(f"{where}: manager must be an fsdptx.FSDP2Manager, got {type(manager).__name__}")
    require_module(model, "model", where)
    batch = require_positive_int(batch, "batch", where)
    seq = require_positive_int(seq, "seq", where)
    check_step_arguments(model, optimizer, where)
    skew = check_routing_skew(routing_skew, where)
    ep = ep_size(manager.moe_mesh)
    if ep <= 1 and skew != 1:
        raise ValueError(
            f"{where}: routing_skew={routing_skew!r} applies to experts split across ep > 1 ranks (their token "
            "dispatch); this manager's moe_mesh has no ep dim > 1"
        )
    if manager.config.pipeline_parallel is not None:
        raise ValueError(
            f"{where}: manager plans pipeline stages (FSDP2Config(pipeline_parallel=...)), whose ranks hold "
            "different stages and micro-batches in flight; size them with fsdptx.estimate_pipeline_memory"
        )
    check_seq_split(manager, seq, cp_rotate, where)
    tp, cp = manager.dims.tp, manager.dims.cp
    if cp > 1 and not attention_projections(model):
        raise ValueError(f"{where}: {no_attention_error(model)}")
    p = manager.plan(model)
    if not p.units:
        raise ValueError(
            f"{where}: the plan has no FSDP unit, and the trace's tracker (FSDPMemTracker) follows FSDP "
            "units; give the mesh a data-parallel dim"
        )
    dispatch = None
    if ep > 1:
        problems = expert_dispatch_problems(model, p)
        if problems:
            raise ValueError(f"{where}: {problems[0]}")
        from ..apply._apply import apply_plan

        dispatch = StaticDispatch(skew)
        apply_plan(p, model, manager.device_mesh, moe_mesh=manager.moe_mesh, hand_ep_mesh=dispatch)
    else:
        manager.parallelize(model)
    shards = param_shards(model, p, manager.dims, fsdp_applied=True)
    units = [u.modules[0] for u in p.units]
    trace = trace_step(
        model, batch=batch, seq=seq // cp, units=units, mesh=manager.device_mesh, vocab_sharded_logits=_loss_parallel(p)
    )
    trace = with_routing(trace, dispatch)
    if cp > 1:
        ring = ring_attention(model, p, cp=cp, tp=tp, rotate_method=cp_rotate, batch=batch, seq=seq)
        trace = with_ring_buffers(trace, ring)
    return estimate_from_trace(trace, shards, batch=batch, seq=seq, optimizer=optimizer)


def check_step_arguments(model: nn.Module, optimizer: object, where: str) -> None:
    """What every traced estimate needs of its model and optimizer, checked
    before the model is touched: a known optimizer, a model on the meta
    device with a token embedding (the trace's input and loss)."""
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"{where}: optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError(f"{where} needs a model built on the meta device (with torch.device('meta'): ...)")
    try:
        vocab_size(model)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None


def check_seq_split(manager: Any, seq: int, cp_rotate: object, where: str) -> None:
    """``seq`` split as ``manager``'s mesh splits it (over the TP ranks under
    sequence parallelism; head-tail over ``2 x cp``) and a known ring rotation."""
    tp, cp = manager.dims.tp, manager.dims.cp
    if manager.config.sequence_parallel and tp > 1 and seq % tp:
        raise ValueError(
            f"{where}: seq={seq} is not divisible by the tensor-parallel size {tp}; sequence parallelism "
            f"splits every sequence over the TP ranks: use a multiple of {tp}"
        )
    if not isinstance(cp_rotate, str) or cp_rotate not in ROTATE_METHODS:
        raise ValueError(f"{where}: cp_rotate must be one of {', '.join(ROTATE_METHODS)}, got {cp_rotate!r}")
    cp_error = cp_seq_error(seq, cp, tp, manager.config.sequence_parallel)
    if cp_error is not None:
        raise ValueError(f"{where}: {cp_error}")


def expert_dispatch_problems(model: nn.Module, plan: Any) -> list[str]:
    """Why the traced step cannot stand in for the token dispatch of the
    expert modules ``plan`` splits across ``ep`` (empty when it can)."""
    ep = plan.expert_parallel
    if ep is None:
        return []
    modules = dict(model.named_modules())
    return static_dispatch_problems({m: modules[m] for m in ep.modules if m in modules})


def with_routing(trace: Trace, dispatch: StaticDispatch | None) -> Trace:
    """``trace`` with the routing ``dispatch`` assumed and its note."""
    routing = None if dispatch is None else dispatch.routing()
    if routing is None:
        return trace
    return replace(trace, routing=routing, notes=(*trace.notes, routing.note()))


def _loss_parallel(plan: Any) -> bool:
    """Whether ``plan`` keeps the head's logits vocabulary-sharded."""
    tp = plan.tensor_parallel
    return tp is not None and tp.loss_parallel


# --------------------------------------------------------------------------- the command line


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Turn off ``use_cache`` on every config the model's modules hold and
    return where, before the dry run plans: the dry run builds its own
    model and decides as ``parallelize`` does under checkpointing (see
    :func:`fsdptx.apply._checkpoint.turn_kv_cache_off`), without its warnings."""
    return turn_kv_cache_off(model)


def traced(
    model: nn.Module,
    plan: Any,
    applied: str,
    batch_seq: tuple[int, int],
    mesh: DeviceMesh,
    *,
    cp: int = 1,
    tp: int = 1,
    cp_rotate: str = "allgather",
    dispatch: StaticDispatch | None = None,
) -> Trace:
    """:func:`trace_step` for the dry run, which has applied ``plan``
    (``applied == "full"``) on the current fake mesh. A plan without units
    (nothing for the trace to follow) and one applied only in part (the
    mesh is over the dry run's budget) are refused, each saying why. With
    ``cp`` > 1 the step is traced at ``seq / cp`` and ring attention's
    buffers (``cp_rotate``) are added (:mod:`fsdptx.cli._cp`); the caller
    has checked that ``seq`` splits. ``dispatch`` is the static token
    dispatch the experts were handed under ``ep`` > 1, whose routing
    assumption the trace then records (:mod:`fsdptx.cli._ep`)."""
    from ._common import APPLY_BUDGET, UsageError

    if not plan.units:
        raise UsageError(
            "the activation trace follows FSDP's units, and this plan has none (one data-parallel rank with "
            "mixed precision off and no offload); drop --batch/--seq/--html, or trace with --mp fp32 (or bf16), "
            "which plans units on one rank too"
        )
    if applied != "full":
        raise UsageError(
            "the activation trace needs fully_shard applied, and this mesh is larger than the dry run "
            f"simulates ({APPLY_BUDGET:,} parameter shards); trace a smaller dp_shard, or use --fit, which "
            "derives the step at large shard counts from traces at small ones"
        )
    batch, seq = batch_seq
    if cp > 1 and not attention_projections(model):
        raise UsageError(no_attention_error(model))
    try:
        trace = trace_step(
            model,
            batch=batch,
            seq=seq // cp,
            units=[u.modules[0] for u in plan.units],
            mesh=mesh,
            vocab_sharded_logits=_loss_parallel(plan),
        )
    except (TypeError, RuntimeError, NotImplementedError) as e:
        raise UsageError(
            f"the training step could not be traced under FakeTensorMode ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}); plan without --batch/--seq for the shape-only figures"
        ) from None
    trace = with_routing(trace, dispatch)
    if cp == 1:
        return trace
    ring = ring_attention(model, plan, cp=cp, tp=tp, rotate_method=cp_rotate, batch=batch, seq=seq)
    return with_ring_buffers(trace, ring)


def memory_json(trace: Trace, shards: Mapping[str, ParamShard], optimizer: str) -> dict[str, Any]:
    """The traced figures the report adds under ``"memory"`` (see :class:`MemoryEstimate`)."""
    batch, seq = trace.batch_seq
    estimate = estimate_from_trace(
        trace, shards, batch=batch, seq=seq, optimizer=optimizer, offload=trace.offloaded
    )
    return estimate.to_json()


def memory_text(m: Mapping[str, Any]) -> list[str]:
    """The lines of the text report for the traced figures of ``memory_json``."""
    from ..core._sizes import format_bytes as fmt_bytes

    breakdown = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(m["peak_breakdown"].items(), key=lambda kv: -kv[1]))
    comm = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m["collective_bytes"].items()) or "none"
    rows = [
        ("activations", f"{fmt_bytes(m['activations_bytes'])} saved when backward starts"),
        ("peak", f"{fmt_bytes(m['peak_bytes'])} ({m['peak_bytes']:,} B) in the {m['peak_at']}"),
        ("at the peak", breakdown),
        ("collectives", comm),
    ]
    cp = m.get("context_parallel")
    if cp is not None:
        rows.append(
            (
                "context parallel",
                f"cp={cp['cp']}, {cp['seq_per_rank']} tokens per CP rank traced; ring attention modelled "
                f"({cp['rotate_method']} rotation): K/V buffer {fmt_bytes(cp['kv_buffer_bytes'])} per layer, "
                f"+ {fmt_bytes(cp['grad_kv_buffer_bytes'])} fp32 dK/dV in backward ({cp['attention_layers']} layers)",
            )
        )
    ep = m.get("expert_parallel")
    if ep is not None:
        routing = "balanced" if ep["routing"] == "balanced" else f"skew {ep['routing_skew']:g}"
        rows.append(
            (
                "expert parallel",
                f"ep={ep['ep']}, routing {routing} (assumed): {ep['tokens_per_expert']} tokens per local expert "
                f"x {ep['local_experts']} local experts; all-to-all {ep['send_rows']} rows out, "
                f"{ep['recv_rows']} in, per experts module",
            )
        )
    rows += [("estimated", note) for note in m["estimated"]]
    width = max(len(k) for k, _ in rows)
    shape = f"batch {m['batch']} x seq {m['seq']}"
    if cp is not None:
        shape += f" (seq/cp = {cp['seq_per_rank']} per CP rank)"
    head = (
        f"one training step traced (forward, backward, AdamW step; {shape} "
        "per data-parallel rank; FakeTensorMode, FSDPMemTracker):"
    )
    return ["", head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
