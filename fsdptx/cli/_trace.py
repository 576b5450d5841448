"""One training step of a parallelized model, traced under ``FakeTensorMode``.

:func:`trace_step` runs forward, the loss, backward, the TP-replica sync and
an AdamW step of a model that ``FSDP2Manager.parallelize`` applied on the
meta device: tensors have shapes and dtypes but no storage, so a 70B model
on 64 ranks runs on a laptop CPU. torch's ``FSDPMemTracker`` is the
accounting engine (it attributes every live storage to parameters,
gradients, activations, all-gather and reduce-scatter buffers, optimizer
state); a subclass records a :class:`Sample` after every operator, with the
FSDP unit and phase running at the time, and every :class:`Collective`
issued, so a report can say *where* the step peaks and draw it.

Two things make the tracker count what a GPU would hold:

- DTensor computes output shapes by running the op on fake tensors of the
  *active* fake mode; the tracker would count those as allocations. During
  the trace DTensor's propagation gets a fake mode of its own
  (``own_propagation_fake_mode`` in :mod:`fsdptx.core._torch_internals`), which the tracker skips.
- AdamW creates its state lazily in the first ``step()``. A steady-state
  step has it from the start, so the state is created (and gradients
  dropped) before the traced step begins.
- A ``transformers`` model trained without a KV cache (checkpointing turns
  it off; pipeline stages run without one) looks for packed sequences in
  its position ids; on fake tensors it cannot see there are none, so it
  would build a ``batch x seq x seq`` mask and pass it to attention
  instead of ``is_causal``, quadratic memory a GPU run never allocates
  (a gigabyte per sequence at 32k tokens). The trace's token rows are one
  sequence each, so it runs under :func:`unpacked_sequences`.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..core._torch_internals import (
    CHECKPOINT_WRAPPED,
    FakeTensorMode,
    FSDPMemTracker,
    fake_device,
    fast_fake_mode_lookup,
    local_tensor,
    op_name,
    own_propagation_fake_mode,
    tree_leaves,
)
from ._ep import ExpertRouting
from ._ring import RingAttention

__all__ = ["CATEGORIES", "RING_BUFFERS", "Collective", "Sample", "Trace", "token_embedding", "trace_step", "unpacked_sequences", "vocab_size", "where_label"]

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

RING_BUFFERS = "cp_ring_buffers"
"""The category of ring attention's K/V rotation buffers, which a CP step
holds and no CPU kernel allocates: modelled, not traced (:mod:`fsdptx.cli._cp`)."""

_DEVICE_QUERY = torch.ops.prim.device.default

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
    FSDP's reduce-scatter: the HSDP replica sync, ``ep`` for the experts'
    token dispatch), its bytes, and where it ran."""

    index: int
    op: str
    source: str
    unit: str
    phase: str
    bytes: int


class _StepTracker(FSDPMemTracker):
    """``FSDPMemTracker`` that also keeps a sample per operator and every collective."""

    def __init__(
        self, mod: nn.Module, optm: torch.optim.Optimizer, units: Sequence[str], more: Sequence[nn.Module] = ()
    ) -> None:
        super().__init__(mod, optm)
        roots = (mod, *more)
        if more:
            # One pipeline rank's stages are FSDP roots of their own; the
            # tracker instruments every FSDP module under the one it holds.
            self._root_mod = nn.ModuleList(roots)  # type: ignore[assignment]  # read only through .modules() and .buffers()
        # The tracker names modules from the root's class name down
        # (``FSDPDecoder.layers.0``); the report uses the plan's FQNs.
        self._units = {(f"{type(r).__name__}.{u}" if u else type(r).__name__): u for r in roots for u in units}
        self._resolved: dict[str, tuple[int, str]] = {}
        self.samples: list[Sample] = []
        self.collectives: list[Collective] = []
        self._counter = 0
        self.stage = ""  # set by the caller: "tp_sync" or "optimizer" after backward

    def _where(self) -> tuple[str, str]:
        if self._in_opt or self.stage:
            return self.stage or "optimizer", ""
        phase = "backward" if self._mod_tracker.is_bw else "forward"
        return phase, max(map(self._unit_of, self._mod_tracker.parents), default=(-1, ""))[1]

    def _unit_of(self, name: str) -> tuple[int, str]:
        """The unit a module the tracker names ``name`` starts, with the
        length of its name (the innermost active unit is the longest), or
        ``(-1, "")``; asked after every operator, so each name is resolved once."""
        known = self._resolved.get(name)
        if known is None:
            plain = name.replace(f".{CHECKPOINT_WRAPPED}", "")
            known = self._resolved[name] = (len(plain), self._units[plain]) if plain in self._units else (-1, "")
        return known

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
        values: Mapping[str, int] = {CATEGORIES[k]: v for k, v in snap.items() if k in CATEGORIES and v}
        if self.samples and self.samples[-1].bytes == values:
            values = self.samples[-1].bytes  # one mapping for a run of equal samples: a trace sent between processes stays small
        sample = Sample(self._counter, phase, unit, values)
        self.samples.append(sample)
        self._counter += 1
        return sample

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _DEVICE_QUERY and DTensor not in types:
            # Fake tensors answer C++'s ``device()`` through dispatch: two in
            # three operators a traced step sees, none allocating. Tracking
            # them would only repeat the last sample, and the fake mode's
            # answer is the tensor's own fake device.
            device = fake_device(args[0])
            return func(*args, **(kwargs or {})) if device is None else device
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
            source = (
                "tp_replica_sync"
                if self.stage == "tp_sync"
                else "replica" if name == "allreduce_" else "ep" if op == "all_to_all" else "tp"
            )
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
    offloaded: bool = False  # traced without CPUOffloadPolicy, which stands for it (see fsdptx.cli._memory)
    notes: tuple[str, ...] = ()  # what was estimated instead of traced
    ring: RingAttention | None = None  # context parallelism's modelled buffers, with cp > 1
    routing: ExpertRouting | None = None  # the static dispatch's routing assumption, with ep > 1


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


def token_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's token embedding: the one it declares
    (``get_input_embeddings``), else its first ``nn.Embedding``."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if isinstance(emb, nn.Embedding):
        return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def vocab_size(model: nn.Module) -> int:
    """The token embedding's row count, which sizes the trace's token ids.

    Raises:
        TypeError: the model has no ``nn.Embedding``.
    """
    emb = token_embedding(model)
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


def _loss_context(vocab_sharded: bool) -> AbstractContextManager[None]:
    """Where the loss and its backward run: under ``loss_parallel`` when
    the logits are vocabulary-sharded DTensors, which plain cross entropy
    refuses (it would mix them with the plain labels)."""
    from ..tp import loss_parallel

    return loss_parallel() if vocab_sharded else contextlib.nullcontext()


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Within: ``transformers`` finds no packed sequences in position ids
    (each row of the traced tokens is one sequence), as it finds on real
    tensors; its own check reads values a fake tensor does not have, and
    then assumes packing (module docstring). Outside, nothing changes.
    Without ``transformers`` imported (or a version without the check) a
    plain context."""
    masks = sys.modules.get("transformers.masking_utils")
    original = getattr(masks, "find_packed_sequence_indices", None)
    if masks is None or original is None:
        yield
        return
    setattr(masks, "find_packed_sequence_indices", _no_packed_sequences)
    try:
        yield
    finally:
        setattr(masks, "find_packed_sequence_indices", original)


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    return local_tensor(t) if isinstance(t, DTensor) else t


def trace_step(
    model: nn.Module,
    *,
    batch: int,
    seq: int,
    units: Sequence[str],
    mesh: DeviceMesh | None = None,
    vocab_sharded_logits: bool = False,
) -> Trace:
    """Trace one training step of ``model``, parallelized on the meta
    device, on the fake mesh that is current.

    Materializes the model as fake tensors, builds AdamW with its state,
    then tracks forward, cross-entropy loss, backward and the optimizer
    step; with a ``tp`` dim in ``mesh`` also the TP-replica gradient sync
    between backward and the optimizer step, as a training loop does.
    With ``vocab_sharded_logits`` (a plan with ``loss_parallel``) the loss
    and its backward run under :func:`fsdptx.loss_parallel`, as the
    training loop of such a plan must: the cross entropy is computed from
    each TP rank's vocabulary slice.
    ``units`` are the FSDP units' first FQNs (samples are attributed to the
    innermost). Mutates ``model`` (its tensors become fake).

    Args:
        model: a model that ``FSDP2Manager.parallelize`` applied on the meta device.
        batch: sequences per data-parallel rank.
        seq: tokens per sequence.
        units: FQNs to attribute samples to.
        mesh: the fake mesh the model was parallelized on.
        vocab_sharded_logits: the model returns vocabulary-sharded logits.

    Returns:
        The samples, the collectives and the activation bytes at the end of forward.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"the memory trace needs an FSDP root; {type(model).__name__} was not sharded "
            "(a mesh with a data-parallel axis and a plan with units)"
        )
    vocab = vocab_size(model)
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        own_propagation_fake_mode(),
        fast_fake_mode_lookup(),
        unpacked_sequences(),
    ):
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
            with _loss_context(vocab_sharded_logits):
                loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
            del logits
            end_of_forward = tracker.sample()
            with _loss_context(vocab_sharded_logits):
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


def where_label(sample: Sample) -> str:
    """``forward of layers.3``, ``backward of <root>``, ``optimizer step``, ``tp_sync``."""
    if sample.phase == "optimizer":
        return "optimizer step"
    if sample.phase not in ("forward", "backward"):
        return sample.phase
    return f"{sample.phase} of {sample.unit or '<root>'}"
