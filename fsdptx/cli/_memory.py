"""Activation memory traced from the model's own forward and backward.

The shape-only :func:`fsdptx.cli._report.memory_plan` is exact for
parameters, gradients and optimizer state but cannot know what a forward
saves. :func:`estimate_memory` runs one real training step (forward, loss,
backward, AdamW step) of the parallelized model on a fake mesh under
``FakeTensorMode``: tensors have shapes and dtypes but no storage, so a 70B
model on 64 ranks runs on a laptop CPU. torch's ``FSDPMemTracker`` is the
accounting engine (it attributes every live storage to parameters, gradients,
activations, all-gather and reduce-scatter buffers, optimizer state); a
subclass records a sample after every operator, with the FSDP unit and
phase running at the time, and every collective issued, so the report can
say *where* the step peaks and draw it.

Two things make the tracker count what a GPU would hold:

- DTensor computes output shapes by running the op on fake tensors of the
  *active* fake mode; the tracker would count those as allocations. During
  the trace DTensor's propagation gets a fake mode of its own
  (``own_propagation_fake_mode`` in :mod:`fsdptx.core._torch_internals`), which the tracker skips.
- AdamW creates its state lazily in the first ``step()``. A steady-state
  step has it from the start, so the state is created (and gradients
  dropped) before the traced step begins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..apply._checkpoint import turn_kv_cache_off
from ..core._torch_internals import (
    CHECKPOINT_WRAPPED,
    FakeTensorMode,
    FSDPMemTracker,
    fast_fake_mode_lookup,
    local_tensor,
    op_name,
    own_propagation_fake_mode,
    tree_leaves,
)
from ._report import OPTIMIZER_STATES, ParamShard

__all__ = ["Collective", "MemoryEstimate", "Sample", "estimate_memory", "trace_step"]

# The tracker's categories (``_FSDPRefType`` values), renamed to JSON keys.
CATEGORIES: dict[str, str] = {
    "Sharded Param": "sharded_params",
    "Unsharded Param": "gathered_params",
    "Buffer": "buffers",
    "Sharded Grad": "sharded_grads",
    "Unsharded Grad": "unsharded_grads",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "all_gather_buffers",
    "Reduce Scatter": "reduce_scatter_buffers",
    "OptState": "optimizer_state",
    "Inputs": "inputs",
}

# Collectives as the tracker sees them, below DTensor and FSDP: FSDP's own
# (c10d in-place ops) and DTensor's functional ones (TP redistributions).
_COLLECTIVES: dict[str, str] = {
    "_allgather_base_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


@dataclass(frozen=True)
class Sample:
    """Memory after one operator: ``index`` orders samples and collectives
    on one time axis; ``unit`` is the innermost FSDP unit running (``""``
    the root) and ``phase`` is ``forward``, ``backward`` or ``optimizer``."""

    index: int
    phase: str
    unit: str
    bytes: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


@dataclass(frozen=True)
class Collective:
    """One collective of the traced step on rank 0: ``op`` (all_gather,
    reduce_scatter, all_reduce, ...), ``source`` (``fsdp`` for FSDP's
    parameter all-gathers and gradient reduce-scatters, ``tp`` for DTensor's
    redistributions in TP regions, ``replica`` for all-reduces outside
    FSDP's reduce-scatter: the HSDP replica sync), its output bytes, and
    where it ran."""

    index: int
    op: str
    source: str
    unit: str
    phase: str
    bytes: int


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
        }


def collective_bytes(collectives: Sequence[Collective]) -> dict[str, int]:
    """Bytes per ``source/op`` (e.g. ``fsdp/all_gather``), summed over the step."""
    out: dict[str, int] = {}
    for c in collectives:
        key = f"{c.source}/{c.op}"
        out[key] = out.get(key, 0) + c.bytes
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- the tracer


class _StepTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that also keeps a sample per operator and every collective."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer, units: Sequence[str]) -> None:
        super().__init__(mod, optm)
        # The tracker names modules from the root's class name down
        # (``FSDPDecoder.layers.0``); the report uses the plan's FQNs.
        root = type(mod).__name__
        self._units = {(f"{root}.{u}" if u else root): u for u in units}
        self.samples: list[Sample] = []
        self.collectives: list[Collective] = []
        self._counter = 0
        self.stage = ""  # set by the caller: "tp_sync" or "optimizer" after backward

    def _where(self) -> tuple[str, str]:
        if self._in_opt or self.stage:
            return self.stage or "optimizer", ""
        phase = "backward" if self._mod_tracker.is_bw else "forward"
        names = [n.replace(f".{CHECKPOINT_WRAPPED}", "") for n in self._mod_tracker.parents]
        active = [n for n in names if n in self._units]
        return phase, self._units[max(active, key=len)] if active else ""

    def _update_peak_stats(self, peak_state: Any) -> None:
        # Called after every operator. The tracker would update each active
        # module's local peak here (a walk over all modules per operator);
        # the per-operator samples make those peaks redundant.
        del peak_state
        self.sample()

    def sample(self) -> Sample:
        """Record (and return) what is held now: also called between
        operators, where frees since the last operator show."""
        phase, unit = self._where()
        snap = next(iter(self._curr_mem_snap.values()), {})
        values = {CATEGORIES[k]: v for k, v in snap.items() if k in CATEGORIES and v}
        sample = Sample(self._counter, phase, unit, values)
        self.samples.append(sample)
        self._counter += 1
        return sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        op = _COLLECTIVES.get(op_name(func)) if out is not NotImplemented else None
        if op is not None:
            self._record_collective(func, op, args)
        return out

    def _record_collective(self, func: Any, op: str, args: Any) -> None:
        name = op_name(func)
        if name in ("_allgather_base_", "_reduce_scatter_base_"):
            source, tensor = "fsdp", args[0] if name == "_allgather_base_" else args[1]
            nbytes = tensor.numel() * tensor.element_size()
        else:
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if op == "all_gather":  # the output is group-size times the input
                group = next((a for a in args if isinstance(a, int)), 1)
                nbytes *= group
            source = "tp_replica_sync" if self.stage == "tp_sync" else "replica" if name == "allreduce_" else "tp"
        phase, unit = self._where()
        self.collectives.append(Collective(self._counter, op, source, unit, phase, nbytes))
        self._counter += 1


@dataclass(frozen=True)
class Trace:
    """The raw result of one traced step (see :func:`trace_step`)."""

    samples: tuple[Sample, ...]
    collectives: tuple[Collective, ...]
    activations: int
    batch_seq: tuple[int, int]
    offloaded: bool = False  # traced without CPUOffloadPolicy, which stands for it (see estimate_from_trace)
    notes: tuple[str, ...] = ()  # what was estimated instead of traced


def _logits(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"the model returned {type(out).__name__}; the memory trace needs logits (a tensor, or an output "
        "with .logits) to compute a language-model loss"
    )


def _vocab_input(model: nn.Module) -> int:
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if not isinstance(emb, nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise TypeError(
            f"{type(model).__name__} has no nn.Embedding; the memory trace feeds token ids (batch, seq) "
            "and needs a token embedding to size them"
        )
    return int(emb.num_embeddings)


def _tp_replica_sync(tracker: _StepTracker, model: nn.Module, mesh: DeviceMesh) -> tuple[str, ...]:
    """Run :func:`fsdptx.synchronize_tp_replica_gradients` as a training
    step does between backward and the optimizer. Where it cannot run under
    fake mode (it reads data-dependent shapes), estimate it: one all-reduce
    of every TP-replicated gradient in its reduce dtype, through buffers of
    at most ``DEFAULT_MAX_BUFFER_BYTES``; returns the note saying so."""
    from ..core._chunks import DEFAULT_MAX_BUFFER_BYTES
    from ..core._dtypes import gradient_reduce_dtype
    from ..tp.sync._ops import synchronize_tp_replica_gradients
    from ._common import _tp_dim

    try:
        synchronize_tp_replica_gradients([model], mesh)
        return ()
    except Exception as e:  # noqa: BLE001 - any failure under fake mode falls back to the estimate
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    nbytes = sum(
        _local(p).numel() * gradient_reduce_dtype(p.dtype).itemsize
        for p in model.parameters()
        if p.requires_grad and _tp_dim(p) is None
    )
    before = tracker.sample()
    buffer = min(nbytes, DEFAULT_MAX_BUFFER_BYTES)
    tracker.samples[-1] = Sample(
        before.index, "tp_sync", "", {**before.bytes, "temporaries": before.bytes.get("temporaries", 0) + buffer}
    )
    tracker.collectives.append(Collective(tracker._counter, "all_reduce", "tp_replica_sync", "", "tp_sync", nbytes))
    tracker._counter += 1
    return (
        f"tp-replica sync: estimated, not traced ({reason}): one all-reduce of {nbytes:,} B of TP-replicated "
        f"gradients through buffers of at most {DEFAULT_MAX_BUFFER_BYTES:,} B",
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def trace_step(
    model: nn.Module, *, batch: int, seq: int, units: Sequence[str], mesh: DeviceMesh | None = None
) -> Trace:
    """Trace one training step of ``model``, parallelized on the meta
    device, on the fake mesh that is current.

    Materializes the model as fake tensors, builds AdamW with its state,
    then tracks forward, cross-entropy loss, backward and the optimizer
    step; with a ``tp`` dim in ``mesh`` also the TP-replica gradient sync
    between backward and the optimizer step, as a training loop does.
    ``units`` are the FSDP units' first FQNs (samples are attributed to the
    innermost). Mutates ``model`` (its tensors become fake).

    Args:
        model: a model that ``FSDP2Manager.parallelize`` applied on the meta device.
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        units: FQNs to attribute samples to.
        mesh: the fake mesh the model was parallelized on.

    Returns:
        The samples, the collectives and the activation bytes at the end of forward.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"the memory trace needs an FSDP root; {type(model).__name__} was not sharded "
            "(a mesh with a data-parallel axis and a plan with units)"
        )
    vocab = _vocab_input(model)
    with FakeTensorMode(allow_non_fake_inputs=True), own_propagation_fake_mode(), fast_fake_mode_lookup():
        model.to_empty(device="cpu")
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        # AdamW steps the local shards: the same tensors and state sizes a
        # DTensor step allocates, without DTensor's dispatch per foreach op
        # (most of the trace's time on a deep model).
        shards = [_local(p) for p in params]
        optimizer = torch.optim.AdamW(shards, lr=1e-4, foreach=True)
        for shard in shards:  # steady state: AdamW's state exists (its documented layout)
            optimizer.state[shard] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(shard),
                "exp_avg_sq": torch.zeros_like(shard),
            }
        tokens = torch.randint(0, vocab, (batch, seq))
        labels = torch.randint(0, vocab, (batch, seq))
        tracker = _StepTracker(model, optimizer, units)
        tracker.track_inputs((tokens, labels))
        with tracker:
            logits = _logits(model(tokens))
            loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
            del logits
            end_of_forward = tracker.sample()
            loss.backward()
            notes: tuple[str, ...] = ()
            if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:
                tracker.stage = "tp_sync"
                notes = _tp_replica_sync(tracker, model, mesh)
            tracker.stage = "optimizer"
            for p, shard in zip(params, shards):
                shard.grad = None if p.grad is None else _local(p.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
    activations = end_of_forward.bytes.get("activations", 0)
    return Trace(tuple(tracker.samples), tuple(tracker.collectives), activations, (batch, seq), notes=notes)


# --------------------------------------------------------------------------- the estimate


def where_label(sample: Sample) -> str:
    """``forward of layers.3``, ``backward of <root>``, ``optimizer step``, ``tp_sync``."""
    if sample.phase == "optimizer":
        return "optimizer step"
    if sample.phase not in ("forward", "backward"):
        return sample.phase
    return f"{sample.phase} of {sample.unit or '<root>'}"


def steady_bytes(shards: Mapping[str, ParamShard], optimizer: str) -> tuple[int, int, int]:
    """Exact per-rank (params, grads, optimizer state) of rank 0's shards."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    params = sum(s.local_numel * s.dtype.itemsize for s in shards.values())
    grads = sum(s.local_numel * s.dtype.itemsize for s in shards.values() if s.requires_grad)
    states = OPTIMIZER_STATES[optimizer] * 4 * sum(s.local_numel for s in shards.values() if s.requires_grad)
    return params, grads, states


def rescale(
    trace: Trace, *, traced: tuple[int, int, int], target: tuple[int, int, int]
) -> tuple[int, int, dict[str, int]]:
    """Peak of ``trace`` when the sharded parts are ``target`` instead of ``traced``.

    Every sample is recomputed with sharded parameters and optimizer state
    scaled to the target totals and sharded gradients scaled in proportion
    (the fraction of gradients already reduced at that moment is kept).
    Unsharded parts (gathered parameters, unsharded gradients, activations,
    communication buffers) do not depend on the FSDP shard count. Returns
    (peak, sample index, breakdown)."""
    keys = ("sharded_params", "sharded_grads", "optimizer_state")
    factors = {k: (t / s if s else 0.0) for k, s, t in zip(keys, traced, target)}
    best, best_i, best_bytes = -1, 0, {}
    for i, sample in enumerate(trace.samples):
        scaled = {k: int(round(v * factors[k])) if k in factors else v for k, v in sample.bytes.items()}
        total = sum(scaled.values())
        if total > best:
            best, best_i, best_bytes = total, i, scaled
    return best, best_i, best_bytes


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
    )


def traced_steady(trace: Trace) -> tuple[int, int, int]:
    """(sharded params, sharded grads once all are reduced, optimizer state)
    as traced: params and state as the step starts (the optimizer step's
    temporaries also count as optimizer state), gradients at their most
    before the optimizer step."""
    first = trace.samples[0].bytes if trace.samples else {}
    grads = max((s.bytes.get("sharded_grads", 0) for s in trace.samples if s.phase != "optimizer"), default=0)
    return first.get("sharded_params", 0), grads, first.get("optimizer_state", 0)


def estimate_memory(
    manager: Any, model: nn.Module, *, batch: int = 1, seq: int = 2048, optimizer: str = "adamw"
) -> MemoryEstimate:
    """The per-rank memory of one training step of ``model`` under ``manager``.

    Plans and parallelizes ``model`` (built on the meta device) with
    ``manager`` on its mesh, which must be a fake mesh
    (:func:`fsdptx.testing.fake_mesh`), then traces forward, backward and
    the optimizer step under ``FakeTensorMode`` (see the module docstring).
    Nothing is allocated; ``model`` is consumed (its tensors become fake).

    Args:
        manager: the :class:`fsdptx.FSDP2Manager` whose plan to size.
        model: the model on the meta device.
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        optimizer: ``adamw`` (2 fp32 states), ``sgd`` (1) or ``none``.

    Returns:
        A :class:`MemoryEstimate` for rank 0.

    Raises:
        ValueError: ``batch`` or ``seq`` is below 1, or ``model`` is not on
            the meta device.

    Example::

        with fsdptx.testing.fake_mesh((8,), ("dp",)) as mesh, torch.device("meta"):
            model = build_model()
            estimate = fsdptx.estimate_memory(fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh), model)
    """
    from ._common import param_shards

    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be >= 1, got batch={batch}, seq={seq}")
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("estimate_memory needs a model built on the meta device (with torch.device('meta'): ...)")
    p = manager.plan(model)
    manager.parallelize(model)
    shards = param_shards(model, p, manager.dims, fsdp_applied=True)
    units = [u.modules[0] for u in p.units]
    trace = trace_step(model, batch=batch, seq=seq, units=units, mesh=manager.device_mesh)
    return estimate_from_trace(trace, shards, batch=batch, seq=seq, optimizer=optimizer)



# --------------------------------------------------------------------------- the command line


def disable_kv_cache(model: nn.Module) -> list[str]:
    """Turn off ``use_cache`` on every config the model's modules hold and
    return where, before the dry run plans: the dry run builds its own
    model and decides as ``parallelize`` does under checkpointing (see
    :func:`fsdptx.apply._checkpoint.turn_kv_cache_off`), without its warnings."""
    return turn_kv_cache_off(model)


def traced(model: nn.Module, plan: Any, applied: str, batch_seq: tuple[int, int], mesh: DeviceMesh) -> Trace:
    """:func:`trace_step` for the dry run, which has applied ``plan``
    (``applied == "full"``) on the current fake mesh."""
    from ._common import APPLY_BUDGET, UsageError

    if applied != "full":
        raise UsageError(
            "the activation trace needs fully_shard applied, and this mesh is larger than the dry run "
            f"simulates ({APPLY_BUDGET:,} parameter shards); trace a smaller dp_shard: activations per "
            "rank do not depend on it, and --fit scales the sharded parts exactly"
        )
    batch, seq = batch_seq
    try:
        return trace_step(model, batch=batch, seq=seq, units=[u.modules[0] for u in plan.units], mesh=mesh)
    except (TypeError, RuntimeError, NotImplementedError) as e:
        raise UsageError(
            f"the training step could not be traced under FakeTensorMode ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}); plan without --batch/--seq for the shape-only figures"
        ) from None


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
    rows += [("estimated", note) for note in m["estimated"]]
    width = max(len(k) for k, _ in rows)
    head = (
        f"one training step traced (forward, backward, AdamW step; batch {m['batch']} x seq {m['seq']} "
        "per data-parallel rank; FakeTensorMode, FSDPMemTracker):"
    )
    return ["", head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)]
