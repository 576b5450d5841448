"""The public TP-replica operations: :func:`broadcast_tp_replicas` and
:func:`synchronize_tp_replica_gradients`, each a straight line of
arguments, context, layout, schedule, agreement and collective."""

from __future__ import annotations

import operator
from collections.abc import Callable
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from ...core._chunks import DEFAULT_MAX_BUFFER_BYTES
from ...core._dtypes import gradient_reduce_dtype
from ...core._torch_internals import local_tensor
from ._context import ModelParts, _TPContext, _check_arguments
from ._layout import _DTYPE, _Layout, _SHAPE, _context_cache, _describe_tensor, _layout, _local, _tp_context
from ._schedule import _execute, _schedule
from ._agreement import _SKIP, _SPARSE, _SYNC, _agree, _call_digest, _overlapped_agreement

__all__ = ["broadcast_tp_replicas", "synchronize_tp_replica_gradients"]


def broadcast_tp_replicas(
    model_parts: ModelParts,
    device_mesh: DeviceMesh | None,
    tp_axis_name: str = "tp",
    *,
    max_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
) -> int:
    """Make every TP-replicated parameter and buffer equal to TP coordinate 0's.

    Call after initialization (or loading) when ranks may have built their
    replicas independently. Integer and non-persistent buffers are included:
    a step counter or rotary cache that differs across TP ranks is the same
    drift in another form. Excluded subtrees and TP-sharded DTensors are left
    alone. Tensors travel through rank-local storage in flat buffers of at
    most ``max_bytes``. Returns the number of tensors broadcast (tied once);
    0 and no collective without a TP axis of size > 1.

    Before anything moves, the TP peers agree (one small all-to-all) on the
    set and order of tensors, their dtypes, rank-local shapes and placements,
    and ``max_bytes``; any difference raises ``RuntimeError`` naming the
    tensors on every peer, with every tensor unchanged.

    Invalid arguments (``max_bytes`` not a positive integer, or too small for
    one element) raise ``TypeError``/``ValueError`` before any collective. If
    only some ranks pass the bad argument, their peers cannot know and wait
    in the agreement collective until the process group's timeout (the
    ``timeout`` given to ``init_process_group``) expires.

    Args:
        model_parts: the model, or the model parts this rank holds, in the
            same order on every rank.
        device_mesh: the mesh the model was parallelized on (``None``: no
            mesh, nothing to do).
        tp_axis_name: the mesh dim name of tensor parallelism.
        max_bytes: the most bytes one communication buffer may take.

    Returns:
        How many tensors were broadcast (tied ones once).

    Raises:
        TypeError: ``max_bytes`` is not a positive integer.
        ValueError: ``max_bytes`` cannot hold one element.
        RuntimeError: the TP peers disagree on what to broadcast.

    Example::

        model = build_model(seed=rank)               # replicas start different
        fsdptx.apply_plan(p, model, mesh)
        fsdptx.broadcast_tp_replicas([model], mesh)  # now equal to TP rank 0's
    """
    where = "broadcast_tp_replicas"
    parts, max_bytes = _check_arguments(where, model_parts, device_mesh, tp_axis_name, max_bytes)
    ctx = _tp_context(device_mesh, tp_axis_name, _context_cache(parts))
    if ctx is None:
        return 0
    layout = _layout(parts, ctx, max_bytes, "broadcast", with_buffers=True)
    tensors = [_local(e.tensor) for e in layout.entries]
    schedule = layout.schedule
    if schedule is None:
        n = len(tensors)
        schedule = _schedule(
            b"",
            [t.shape for t in tensors],
            [t.dtype for t in tensors],
            [t.device for t in tensors],
            [False] * n,
            lambda d: d,
            max_bytes,
            where,
            [e.fqn for e in layout.entries],
        )
    agree = _overlapped_agreement(
        schedule, lambda slot: _agree(where, ctx, layout, max_bytes, 0, b"", [], [], slot), ctx
    )
    src = ctx.ranks[0]
    with torch.no_grad():
        _execute(schedule, tensors, lambda buf: dist.broadcast(buf, src=src, group=ctx.group), 1.0, agree)
    layout.schedule = schedule
    return len(tensors)


def synchronize_tp_replica_gradients(
    model_parts: ModelParts,
    device_mesh: DeviceMesh | None,
    tp_axis_name: str = "tp",
    *,
    max_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
) -> int:
    """Reduce TP-replicated gradients across the TP group, once per optimizer step.

    Call after gradient accumulation and before scaling, norm computation,
    clipping and ``optimizer.step()``: ``sum`` reductions are not idempotent,
    so a second call in the same step would double-count. ``mean`` gradients
    (redundant full computation, the default) become the TP-group sum divided
    by its size; ``sum`` gradients (disjoint partial contributions) the sum.

    All replicated gradients travel together: a mean is a sum followed by a
    division and low-precision gradients are reduced in fp32 anyway, so one
    fp32 buffer per chunk carries every mean and sum, bf16 and fp32 gradient
    of a device (fp64 ones get their own). Chunks are bounded by ``max_bytes``
    (the mean's divisor included) and laid out in rank-stable order; DTensor
    gradients are reduced through their local storage and keep shape and
    placements. Excluded, TP-sharded and TP-partial tensors are untouched,
    and so are DTensors ``Replicate`` on the ``tp_axis_name`` dim of their
    mesh (torch's ``SequenceParallel`` norms, a ``RowwiseParallel`` bias):
    DTensor reduces their gradients itself (Partial -> Replicate in
    backward), so reducing them again would cost a collective and, for a
    ``sum`` mark, count them ``tp`` times. A plain replica, a DTensor on a
    mesh without TP peers (FSDP's data-parallel one), or one replicated
    across them under another dim name, is reduced.

    When nothing is left to reduce, the call returns 0 without any
    collective, the agreement included: what takes part follows from the
    model's structure, marks and placements, which applying the same plan
    makes the same on every TP rank. Only a peer whose model holds a plain
    replica the others lack would then wait in the agreement alone, until
    the process group's timeout.

    Before touching anything the TP group agrees (see :func:`_agree`) on
    everything that shapes the collectives: the set and order of
    parameters, their dtypes, rank-local shapes, placements and reduction
    marks, each gradient's presence and layout, and ``max_bytes``. A
    difference, or a sparse replicated gradient on any peer, raises
    ``RuntimeError`` naming the parameters on every peer, with every
    gradient unchanged.

    Invalid arguments (``max_bytes`` not a positive integer, or too small for
    one element plus the divisor) raise ``TypeError``/``ValueError`` before
    any collective, with every gradient unchanged. If only some ranks pass
    the bad argument, their peers cannot know and wait in the agreement
    collective until the process group's timeout (the ``timeout`` given to
    ``init_process_group``) expires, then raise there.

    What the call derives from the model (order, groups, buffer layout, the
    layout digest) is cached on the first model part and reused while the
    model's parameters (down to each one's dtype, shape and device: a cast
    keeps the Parameter objects), buffers, submodules, marks and the
    arguments stay the same; so is one buffer of at most ``max_bytes`` per
    device.

    Args:
        model_parts: the model, or the model parts this rank holds, in the
            same order on every rank.
        device_mesh: the mesh the model was parallelized on (``None``: no
            mesh, nothing to do).
        tp_axis_name: the mesh dim name of tensor parallelism.
        max_bytes: the most bytes one communication buffer may take.

    Returns:
        How many rank-local gradients were synchronized (tied ones once);
        0, and no collective, without a TP axis of size > 1 or without a
        plain replica to reduce.

    Raises:
        TypeError: ``max_bytes`` is not a positive integer.
        ValueError: ``max_bytes`` cannot hold one element and the divisor.
        RuntimeError: the TP peers disagree on what to reduce, or a
            replicated gradient is sparse.

    Example::

        loss.backward()
        fsdptx.synchronize_tp_replica_gradients([model], mesh)  # once per optimizer step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    """
    where = "synchronize_tp_replica_gradients"
    parts, max_bytes = _check_arguments(where, model_parts, device_mesh, tp_axis_name, max_bytes)
    ctx = _tp_context(device_mesh, tp_axis_name, _context_cache(parts))
    if ctx is None:
        return 0
    layout = _layout(parts, ctx, max_bytes, "sync", with_buffers=False, dtensor_axis=tp_axis_name)
    if not layout.entries:
        return 0  # nothing to reduce: no agreement either (see the docstring)
    states, grads, deviations, sparse = _grad_states(layout, ctx)
    key = states + "\n".join(deviations).encode()
    schedule = layout.schedule
    if schedule is None or schedule.key != key:
        layout.schedule = None  # release the old buffer before a new one is allocated
        synced = [i for i, s in enumerate(states) if s == _SYNC]
        schedule = _schedule(
            key,
            [grads[i].shape for i in synced],
            [grads[i].dtype for i in synced],
            [grads[i].device for i in synced],
            [layout.entries[i].reduction == "mean" for i in synced],
            gradient_reduce_dtype,
            max_bytes,
            where,
            [layout.entries[i].fqn for i in synced],
        )
        schedule.synced = synced
        schedule.call_digest = _call_digest(states, deviations)
    synced = schedule.synced
    agree = _overlapped_agreement(
        schedule,
        lambda slot: _agree(where, ctx, layout, max_bytes, schedule.call_digest, states, deviations, sparse, slot),
        ctx,
    )
    tensors = grads if len(synced) == len(grads) else [grads[i] for i in synced]
    with torch.no_grad():
        _execute(
            schedule,
            tensors,
            lambda buf: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group),
            float(len(ctx.ranks)),
            agree,
        )
    layout.schedule = schedule
    return len(synced)


def _grad_states(
    layout: _Layout, ctx: _TPContext
) -> tuple[bytes, list[torch.Tensor], list[str], list[str]]:
    """Per entry, what its gradient is this call: (one state byte per entry,
    the rank-local gradients (a placeholder where there is none), one
    ``"fqn\\0description"`` per gradient that departs from its parameter's
    dtype, local shape or placements, the FQNs of sparse gradients).

    The common case, a dense gradient laid out like its parameter, is fully
    described by the cached layout digest; :func:`_common_grads` checks it
    for all entries at once.
    """
    common = _common_grads(layout)
    if common is not None:
        return bytes([_SYNC]) * len(common), common, [], []
    states = bytearray(len(layout.entries))
    grads: list[torch.Tensor] = []
    deviations: list[str] = []
    sparse: list[str] = []
    replicated: Callable[[torch.Tensor], bool] | None = None
    strided = torch.strided
    expected = zip(layout.entries, layout.placements, layout.local_dtypes, layout.local_shapes)
    for i, (entry, placements, dtype, shape) in enumerate(expected):
        p = entry.tensor
        g = p.grad
        if g is None:
            grads.append(p)
            continue
        if g.layout is not strided:
            states[i] = _SPARSE
            sparse.append(entry.fqn)
            grads.append(p)
            continue
        if placements is None:
            # A DTensor gradient on a plain parameter travels through its
            # local storage like any other, described as a deviation.
            local, same = (local_tensor(g), False) if isinstance(g, DTensor) else (g, True)
        elif isinstance(g, DTensor):
            local = local_tensor(g)
            same = g.placements == placements and g.device_mesh is p.device_mesh  # type: ignore[attr-defined]
        else:
            local, same = g, False
        if not (same and local.dtype is dtype and local.shape == shape):
            replicated = replicated or ctx.replicated()
            if not replicated(g):
                states[i] = _SKIP
                grads.append(p)
                continue
            deviations.append(f"{entry.fqn}\0{_describe_tensor(g)}")
        states[i] = _SYNC
        grads.append(local)
    return bytes(states), grads, deviations, sparse


_GRAD = operator.attrgetter("grad")


_LAYOUT = operator.attrgetter("layout")


def _common_grads(layout: _Layout) -> list[torch.Tensor] | None:
    """The rank-local gradients when every entry has one that is dense and
    laid out like its parameter (what :func:`_grad_states`' loop would mark
    ``_SYNC`` with no deviation), else ``None`` (then the loop decides).

    The same checks as the loop, a little stricter (exact types), each one
    C-level ``map`` over all entries: a few microseconds instead of one
    Python iteration per entry.
    """
    grads = [*map(_GRAD, layout.tensors)]
    if [*map(type, grads)] != layout.grad_types:  # also catches None
        return None
    if {*map(_LAYOUT, grads)} != {torch.strided}:
        return None if grads else []
    local = layout.placed_locals(grads)
    if local is None or [*map(_DTYPE, local)] != layout.local_dtypes or [*map(_SHAPE, local)] != layout.local_shapes:
        return None
    return local
