"""TP-replica synchronization: keep tensor-parallel replicas identical.

Under sequence parallelism, parameters every TP rank holds in full (norm
weights, biases, router parameters) receive a different gradient on each TP
rank. Reducing them once per optimizer step keeps the replicas from drifting.
This module is the effect layer for that: it issues collectives, in
rank-stable order, over flat buffers bounded by :func:`gradient_chunks`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._chunks import DEFAULT_MAX_BUFFER_BYTES, gradient_chunks
from ._dtypes import gradient_reduce_dtype
from ._marks import is_excluded_from_tp_replica_sync, module_reductions
from ._plan import Reduction
from ._tree import rank_stable_unique

__all__ = ["broadcast_tp_replicas", "is_tp_replicated", "synchronize_tp_replica_gradients"]

ModelParts = Sequence[nn.Module] | nn.Module


def is_tp_replicated(
    tensor: torch.Tensor,
    tp_group_ranks: Sequence[int],
    current_rank: int,
    tp_axis_name: str,
) -> bool:
    """Whether ``tensor``'s rank-local storage is a copy of every TP peer's.

    A plain tensor is a full replica. A DTensor is one when every TP peer that
    appears in its mesh differs from this rank only along mesh dims where the
    DTensor is ``Replicate``. Comparing coordinates, not axis names, covers
    both awkward cases: a DTensor on a DP-only submesh holds no TP peer and is
    a replica on each TP rank; an MoE mesh that folds the TP ranks into
    ``ep``/``ep_shard`` shards along those dims, so the copies differ.
    ``tp_axis_name`` is accepted for the seed's signature; the coordinates
    already say everything it would.
    """
    del tp_axis_name
    if not isinstance(tensor, DTensor):
        return True
    return _replicated_on_mesh(tensor.device_mesh, tuple(tensor.placements), tuple(tp_group_ranks), current_rank)


def _replicated_on_mesh(
    mesh: DeviceMesh, placements: tuple[object, ...], tp_group_ranks: tuple[int, ...], current_rank: int
) -> bool:
    ranks = mesh.mesh
    mine = (ranks == current_rank).nonzero()
    if mine.numel() == 0:
        return True  # this rank holds no shard of it at all: nothing to compare
    me = mine[0].tolist()
    for peer in tp_group_ranks:
        if peer == current_rank:
            continue
        found = (ranks == peer).nonzero()
        if found.numel() == 0:
            continue  # the peer is not in this tensor's mesh: it keeps its own copy
        for dim, (a, b) in enumerate(zip(me, found[0].tolist())):
            if a != b and not placements[dim].is_replicate():  # type: ignore[attr-defined]
                return False
    return True


@dataclass(frozen=True)
class _TPContext:
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    rank: int
    device: torch.device

    def replicated(self) -> Callable[[torch.Tensor], bool]:
        """``is_tp_replicated`` memoised per (mesh, placements) for one call."""
        cache: dict[tuple[int, tuple[object, ...]], bool] = {}

        def check(t: torch.Tensor) -> bool:
            if not isinstance(t, DTensor):
                return True
            key = (id(t.device_mesh), tuple(t.placements))
            if key not in cache:
                cache[key] = _replicated_on_mesh(t.device_mesh, key[1], self.ranks, self.rank)
            return cache[key]

        return check


def _tp_context(device_mesh: DeviceMesh | None, tp_axis_name: str) -> _TPContext | None:
    """The TP group, or ``None`` when there is nothing to synchronize (no mesh,
    no axis of that name, or an axis of size 1)."""
    names = device_mesh.mesh_dim_names if device_mesh is not None else None
    if device_mesh is None or not names or tp_axis_name not in names:
        return None
    tp_mesh = device_mesh[tp_axis_name]
    if tp_mesh.size() == 1:
        return None
    group = tp_mesh.get_group()
    if tp_mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(tp_mesh.device_type, torch.get_device_module(tp_mesh.device_type).current_device())
    return _TPContext(group, tuple(dist.get_process_group_ranks(group)), dist.get_rank(), device)


@dataclass(frozen=True)
class _Entry:
    fqn: str
    tensor: torch.Tensor
    reduction: Reduction


def _collect(parts: list[nn.Module]) -> tuple[list[_Entry], list[_Entry]]:
    """Every parameter and buffer outside excluded subtrees, once each, in
    rank-stable order: one walk of the model per call.

    A tensor reachable under an excluded module through any of its names stays
    rank-local. A tied parameter takes the reduction of its smallest name, so
    every rank resolves a conflict the same way.
    """
    params: list[tuple[int, str, torch.Tensor, Reduction]] = []
    buffers: list[tuple[int, str, torch.Tensor, Reduction]] = []
    excluded: set[int] = set()
    for index, part in enumerate(parts):
        stack: list[tuple[str, nn.Module, bool]] = [("", part, False)]
        while stack:
            fqn, module, under_excluded = stack.pop()
            under_excluded = under_excluded or is_excluded_from_tp_replica_sync(module)
            prefix = fqn + "." if fqn else ""
            marks = module_reductions(module)
            for name, p in module._parameters.items():
                if p is not None:
                    params.append((index, prefix + name, p, marks.get(name, "mean")))
                    if under_excluded:
                        excluded.add(id(p))
            for name, b in module._buffers.items():
                if b is not None:
                    buffers.append((index, prefix + name, b, "mean"))
                    if under_excluded:
                        excluded.add(id(b))
            stack.extend((prefix + n, c, under_excluded) for n, c in module._modules.items() if c is not None)

    def kept(entries: list[tuple[int, str, torch.Tensor, Reduction]]) -> list[_Entry]:
        return [_Entry(f, t, r) for _i, f, t, r in rank_stable_unique(entries) if id(t) not in excluded]

    return kept(params), kept(buffers)


def _local(t: torch.Tensor) -> torch.Tensor:
    """Rank-local storage of a tensor or DTensor (writes reach the original)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _parts(model_parts: ModelParts) -> list[nn.Module]:
    return [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one foreach op; it casts per
    tensor in place (unlike a casting ``cat``, which stages every input
    through a temporary and would push the peak past the buffer budget)."""
    torch._foreach_copy_(dst, src)


def _run_chunked(
    tensors: list[torch.Tensor],
    comm_dtype: Callable[[torch.dtype], torch.dtype],
    max_bytes: int,
    collective: Callable[[torch.Tensor], None],
    divide: Sequence[bool] = (),
    divisor: float = 1.0,
) -> None:
    """Communicate ``tensors`` in place through flat buffers of at most
    ``max_bytes``, one group per (device, communication dtype), in the given
    order; afterwards tensor ``i``'s values are divided by ``divisor`` where
    ``divide[i]`` (a mean is a sum, then this division).

    Packing and unpacking are a few foreach ops per chunk rather than a few
    small ops per tensor, which is what keeps the local work small next to the
    collective. One allocation per group is reused by every chunk:
    a fresh buffer per chunk could overlap the previous one, which the
    backend's worker thread may release only after the next is allocated. So
    the extra memory is bounded by the budget, plus the divisor scalar and
    contiguous copies of any non-contiguous tensors (rare for gradients).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():  # empty tensors have nothing to communicate
            groups.setdefault((t.device, comm_dtype(t.dtype)), []).append(i)
    for (device, dtype), members in groups.items():
        work = [tensors[i] if tensors[i].is_contiguous() else tensors[i].contiguous() for i in members]
        flat = [w.view(-1) for w in work]
        owner, consumed = 0, 0
        # One scalar tensor for the whole group (4 bytes for fp32): a Python
        # number would be wrapped in a fresh one per segment.
        scale = torch.tensor(divisor, dtype=dtype, device=device) if divide else None
        storage: torch.Tensor | None = None
        for chunk in gradient_chunks(flat, max_bytes):
            sizes = [piece.numel() for piece in chunk]
            numel = sum(sizes)
            if storage is None or storage.numel() < numel:
                storage = None  # free the smaller one before allocating
                storage = torch.empty(numel, dtype=dtype, device=device)
            buffer = storage[:numel]
            segments = list(buffer.split(sizes))
            _copy_all(segments, chunk)
            collective(buffer)
            to_divide = []
            for size, segment in zip(sizes, segments):
                if consumed == flat[owner].numel():  # pieces arrive in tensor order
                    owner, consumed = owner + 1, 0
                if divide and divide[members[owner]]:
                    to_divide.append(segment)
                consumed += size
            if to_divide:
                torch._foreach_div_(to_divide, scale)  # type: ignore[arg-type]
            _copy_all(chunk, segments)
            del buffer, segments, to_divide
        storage = None
        for i, w in zip(members, work):
            if w is not tensors[i]:
                tensors[i].copy_(w)


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
    """
    ctx = _tp_context(device_mesh, tp_axis_name)
    if ctx is None:
        return 0
    params, buffers = _collect(_parts(model_parts))
    replicated = ctx.replicated()
    chosen = [_local(e.tensor) for e in (*params, *buffers) if replicated(e.tensor)]
    src = ctx.ranks[0]
    with torch.no_grad():
        _run_chunked(chosen, lambda d: d, max_bytes, lambda buf: dist.broadcast(buf, src=src, group=ctx.group))
    return len(chosen)


# Per-parameter gradient states exchanged before any reduction.
_NO_GRAD, _DENSE, _SPARSE = 0, 1, 2
_HASH_MASK = (1 << 62) - 1


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _HASH_MASK


def _candidates(parts: list[nn.Module], ctx: _TPContext) -> list[_Entry]:
    """Replicated, non-excluded parameters in rank-stable order: the set every
    TP peer must agree on, whatever their grads look like."""
    replicated = ctx.replicated()
    return [e for e in _collect(parts)[0] if replicated(e.tensor)]


def _state(p: torch.Tensor) -> tuple[int, str, int]:
    g = p.grad
    if g is None:
        return (_NO_GRAD, "", 0)
    if g.is_sparse or g.layout != torch.strided:
        return (_SPARSE, "", 0)
    local = _local(g)
    return (_DENSE, str(local.dtype), local.numel())


def _agree(ctx: _TPContext, cands: list[_Entry]) -> None:
    """Check, with one small collective, that all TP peers are about to reduce
    the same thing; raise the same ``RuntimeError`` on every peer if not.

    Each rank contributes (count, digest of FQNs, digest of grad states, any
    sparse) and their negations to one MAX all-reduce, which yields both the
    maximum and the minimum across the group. Every peer sees the same result
    and so takes the same branch: no peer can wait in a collective that
    another skipped. Only on disagreement is a second collective of per-
    parameter states run, to name the parameters; its size is known equal
    because the counts and FQN digests agreed. On a fake process group the
    collective returns the local input, so local checks (sparsity) still fire.
    """
    states = [_state(c.tensor) for c in cands]
    fqn_digest = _digest("\0".join(c.fqn for c in cands).encode())
    state_digest = _digest(repr(states).encode())
    any_sparse = int(any(s[0] == _SPARSE for s in states))
    local = torch.tensor([len(cands), fqn_digest, state_digest, any_sparse], dtype=torch.int64)
    reduced = torch.cat([local, -local]).to(ctx.device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=ctx.group)
    hi, lo = reduced[:4].tolist(), [-v for v in reduced[4:].tolist()]
    if hi[0] != lo[0] or hi[1] != lo[1]:
        raise RuntimeError(
            f"synchronize_tp_replica_gradients: TP peers {list(ctx.ranks)} hold different sets of "
            f"replicated parameters ({lo[0]}..{hi[0]} per rank); every TP rank must pass the same "
            "model parts with the same exclusions. No gradient was modified."
        )
    if hi[2] == lo[2] and hi[3] == 0:
        return
    per_param = torch.tensor([s[0] for s in states], dtype=torch.int64)
    both = torch.cat([per_param, -per_param]).to(ctx.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=ctx.group)
    n = len(cands)
    p_hi, p_lo = both[:n].tolist(), [-v for v in both[n:].tolist()]
    sparse = [c.fqn for c, h in zip(cands, p_hi) if h == _SPARSE]
    if sparse:
        raise RuntimeError(
            "synchronize_tp_replica_gradients: sparse gradients on TP-replicated parameters "
            f"{sparse} (on at least one TP peer) cannot be flattened into a reduction buffer; use "
            "dense gradients for them (e.g. nn.Embedding(sparse=False)) or exclude their module "
            "with exclude_from_tp_replica_sync. No gradient was modified."
        )
    differ = [c.fqn for c, h, l in zip(cands, p_hi, p_lo) if h != l]
    if differ:
        raise RuntimeError(
            "synchronize_tp_replica_gradients: gradient presence differs across TP peers "
            f"{list(ctx.ranks)} for {differ}: some peers have a gradient and others None. "
            "Reducing anyway would hang the peers that skip the collective. Make every TP rank "
            "run the same modules (or zero-fill unused gradients) before synchronizing. "
            "No gradient was modified."
        )
    raise RuntimeError(
        "synchronize_tp_replica_gradients: TP peers disagree on the dtype or size of replicated "
        f"gradients among {[c.fqn for c in cands][:10]}...; check that every TP rank built the "
        "same model. No gradient was modified."
    )


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
    and issued in rank-stable FQN order; DTensor gradients are reduced
    through their local storage and keep shape and placements. Excluded,
    TP-sharded and TP-partial tensors are untouched.

    Before touching anything the TP group agrees on what it will reduce (see
    :func:`_agree`): a gradient present on some peers and ``None`` on others,
    or a sparse replicated gradient, raises ``RuntimeError`` naming the
    parameters on every peer, with every gradient unchanged.

    Returns the number of rank-local gradients synchronized (tied once);
    0 and no collective without a TP axis of size > 1.
    """
    ctx = _tp_context(device_mesh, tp_axis_name)
    if ctx is None:
        return 0
    parts = _parts(model_parts)
    cands = _candidates(parts, ctx)
    _agree(ctx, cands)
    replicated = ctx.replicated()
    chosen = [c for c in cands if c.tensor.grad is not None and replicated(c.tensor.grad)]
    grads = [_local(c.tensor.grad) for c in chosen]  # type: ignore[arg-type]
    with torch.no_grad():
        _run_chunked(
            grads,
            gradient_reduce_dtype,
            max_bytes,
            lambda buf: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group),
            divide=[c.reduction == "mean" for c in chosen],
            divisor=float(len(ctx.ranks)),
        )
    return len(chosen)

