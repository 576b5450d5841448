"""TP-replica synchronization: keep tensor-parallel replicas identical.

Under sequence parallelism, parameters every TP rank holds in full (norm
weights, biases, router parameters) receive a different gradient on each TP
rank. Reducing them once per optimizer step keeps the replicas from drifting.
This module is the effect layer for that: it issues collectives, in
rank-stable order, over flat buffers bounded by :func:`gradient_chunks`.
"""

from __future__ import annotations

import hashlib
import math
import operator
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core._caches import caches_enabled
from ..core._chunks import DEFAULT_MAX_BUFFER_BYTES, gradient_chunks
from ..core._dtypes import gradient_reduce_dtype
from ._marks import is_excluded_from_tp_replica_sync, marks_generation, module_reductions
from ..plan._types import Reduction
from ..core._tree import rank_stable_unique

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

    Args:
        tensor: a plain tensor or a DTensor.
        tp_group_ranks: the global ranks of this rank's TP group.
        current_rank: this rank's global rank.
        tp_axis_name: the TP mesh dim name (kept for the seed's signature).

    Returns:
        Whether this rank's local storage is a copy of every TP peer's.

    Example::

        tp_ranks = mesh["tp"].mesh.flatten().tolist()
        replicated = [n for n, p in model.named_parameters() if fsdptx.is_tp_replicated(p, tp_ranks, rank, "tp")]
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


# ----------------------------------------------------------------------------
# Arguments: checked on each rank before it enters any collective.


def _check_arguments(
    where: str, model_parts: object, device_mesh: object, tp_axis_name: object, max_bytes: object
) -> tuple[list[nn.Module], int]:
    """Validate every argument locally; return the model parts as a list and
    ``max_bytes`` as an int.

    Checking before the first collective means a bad argument never leaves
    half the gradients reduced (a retry would then double-count ``sum``s).
    A rank that raises here has entered no collective; if only some ranks
    passed the bad argument, their peers wait in the agreement collective
    until the process group's timeout expires (see the public docstrings).
    """
    if type(max_bytes) is int and max_bytes > 0 and type(tp_axis_name) is str:  # the common case, cheaply
        if isinstance(model_parts, nn.Module):
            parts = [model_parts]
        elif type(model_parts) is list and model_parts and all(isinstance(m, nn.Module) for m in model_parts):
            parts = list(model_parts)
        else:
            parts = None
        if parts is not None and (device_mesh is None or isinstance(device_mesh, DeviceMesh)):
            return parts, max_bytes
    if isinstance(model_parts, nn.Module):
        parts = [model_parts]
    elif isinstance(model_parts, Sequence) and all(isinstance(m, nn.Module) for m in model_parts):
        parts = list(model_parts)
    else:
        raise TypeError(f"{where}: model_parts must be an nn.Module or a sequence of them, got {model_parts!r}")
    if not parts:
        raise ValueError(f"{where}: model_parts is empty; pass the model, or every pipeline stage this rank holds")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"{where}: device_mesh must be a DeviceMesh or None, got {type(device_mesh).__name__}")
    if not isinstance(tp_axis_name, str):
        raise TypeError(f"{where}: tp_axis_name must be a str, got {tp_axis_name!r}")
    if isinstance(max_bytes, bool) or not hasattr(type(max_bytes), "__index__"):
        raise TypeError(f"{where}: max_bytes must be an integer number of bytes, got {max_bytes!r}")
    size = operator.index(max_bytes)  # type: ignore[arg-type]
    if size <= 0:
        raise ValueError(f"{where}: max_bytes must be positive, got {size}")
    return parts, size


# ----------------------------------------------------------------------------
# The TP context.


@dataclass(frozen=True)
class _TPContext:
    group: dist.ProcessGroup
    group_name: str  # what caches key on: never the object (see _RememberedContext)
    ranks: tuple[int, ...]
    rank: int
    device: torch.device

    def replicated(self) -> Callable[[torch.Tensor], bool]:
        """``is_tp_replicated`` memoised per (mesh, placements)."""
        cache: dict[tuple[int, tuple[object, ...]], bool] = {}

        def check(t: torch.Tensor) -> bool:
            if not isinstance(t, DTensor):
                return True
            key = (id(t.device_mesh), tuple(t.placements))
            if key not in cache:
                cache[key] = _replicated_on_mesh(t.device_mesh, key[1], self.ranks, self.rank)
            return cache[key]

        return check


_CPU = torch.device("cpu")


def _device(device_type: str) -> torch.device:
    """The device collectives of a mesh of ``device_type`` use on this rank
    now (for an accelerator, the current one)."""
    if device_type == "cpu":
        return _CPU
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


@dataclass(frozen=True)
class _RememberedContext:
    """A TP context kept on the model's cache for the next call with the
    same mesh and axis: deriving it goes through half a dozen
    ``torch.distributed`` lookups, tens of microseconds once a backward pass
    has evicted them from the CPU caches.

    Mesh and process group are held by weak reference: a strong one on the
    model would keep a destroyed process group alive until interpreter exit,
    where tearing down its threads aborts the process. A mesh's groups are
    fixed when it is made, and a rank's place in a group for the group's
    life, so while both references are alive the context is still right;
    the device is read anew each call (an accelerator's current device may
    change).
    """

    mesh: weakref.ref[DeviceMesh]
    axis: str
    group: weakref.ref[dist.ProcessGroup]
    group_name: str
    ranks: tuple[int, ...]
    rank: int
    device_type: str

    def recall(self, device_mesh: DeviceMesh | None, tp_axis_name: str) -> _TPContext | None:
        """The context for this mesh and axis, or ``None`` when it is another
        one or either reference died."""
        mesh = self.mesh()
        if mesh is None or mesh is not device_mesh or self.axis != tp_axis_name:
            return None  # a dead mesh is None, which must not match device_mesh=None
        group = self.group()
        if group is None:
            return None
        return _TPContext(group, self.group_name, self.ranks, self.rank, _device(self.device_type))


def _tp_context(
    device_mesh: DeviceMesh | None, tp_axis_name: str, cache: _LayoutCache | None
) -> _TPContext | None:
    """The TP group, or ``None`` when there is nothing to synchronize (no mesh,
    no axis of that name, or an axis of size 1). Recalled from, and
    remembered on, the model's ``cache`` when it has one."""
    if cache is not None and cache.context is not None:
        ctx = cache.context.recall(device_mesh, tp_axis_name)
        if ctx is not None:
            return ctx
    names = device_mesh.mesh_dim_names if device_mesh is not None else None
    if device_mesh is None or not names or tp_axis_name not in names:
        return None
    tp_mesh = device_mesh[tp_axis_name]
    if tp_mesh.size() == 1:
        return None
    group = tp_mesh.get_group()
    ranks = tuple(dist.get_process_group_ranks(group))
    ctx = _TPContext(group, group.group_name, ranks, dist.get_rank(), _device(tp_mesh.device_type))
    if cache is not None:
        cache.context = _RememberedContext(
            weakref.ref(device_mesh), tp_axis_name, weakref.ref(group), ctx.group_name, ranks, ctx.rank,
            tp_mesh.device_type,
        )
    return ctx


# ----------------------------------------------------------------------------
# The walk, and the layout derived from it (cached across calls).


@dataclass(frozen=True)
class _Entry:
    fqn: str
    tensor: torch.Tensor
    reduction: Reduction


def _walk(
    parts: list[nn.Module], *, honour_exclusions: bool = True
) -> tuple[list[_Entry], list[_Entry], list[nn.Module]]:
    """Every parameter and buffer outside excluded subtrees, once each, in
    rank-stable order, plus every module visited (what the cache watches).

    A tensor reachable under an excluded module through any of its names stays
    rank-local. A tied parameter takes the reduction of its smallest name, so
    every rank resolves a conflict the same way. ``honour_exclusions=False``
    keeps excluded subtrees too: data-parallel replicas must hold even a
    TP-rank-local tensor alike (the replica audit's data-parallel dims).
    """
    params: list[tuple[int, str, torch.Tensor, Reduction]] = []
    buffers: list[tuple[int, str, torch.Tensor, Reduction]] = []
    excluded: set[int] = set()
    modules: list[nn.Module] = []
    for index, part in enumerate(parts):
        stack: list[tuple[str, nn.Module, bool]] = [("", part, False)]
        while stack:
            fqn, module, under_excluded = stack.pop()
            modules.append(module)
            under_excluded = under_excluded or (honour_exclusions and is_excluded_from_tp_replica_sync(module))
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

    return kept(params), kept(buffers), modules


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_PLACEMENTS = operator.attrgetter("placements")
_MESH = operator.attrgetter("device_mesh")
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_PARAMETERS = operator.attrgetter("_parameters")
_MODULES = operator.attrgetter("_modules")
_BUFFERS = operator.attrgetter("_buffers")
_ABSENT = object()  # what dict.get returns for a key that is gone (a value may be None)


class _Structure:
    """What a walk read from the modules it visited: their parameter, child
    and (``with_buffers``) buffer dicts, every key in them and the object
    under each key. Buffers are read only for the operation that uses them
    (broadcast); the sync's layout does not depend on them.

    :meth:`unchanged` is true exactly when every module still holds the same
    dict objects, each mapping the same keys to the same objects: then a
    fresh walk would visit the same modules and find the same tensors under
    the same names (adding, removing, renaming, moving or replacing anything
    makes it false). Only the order of keys within a dict may have changed,
    and nothing derived from the walk depends on it: entries are sorted by
    name (:func:`rank_stable_unique`).

    It runs on every call, so it compares identities with C-level maps
    over flat lists prepared here, instead of rebuilding a snapshot: per
    module, one attribute read per dict kind; per key, one ``dict.get``.
    It holds every object it compares against, which is what makes an
    identity check sound (an id alone could be reused by a new object once
    the old one is freed; this also covers the ids of the model parts in a
    layout's key). So a tensor removed from the model stays alive until the
    next call rebuilds the layout, or until the model is released.
    """

    def __init__(self, modules: list[nn.Module], with_buffers: bool) -> None:
        self.modules = modules
        self.getters = (_PARAMETERS, _MODULES, _BUFFERS) if with_buffers else (_PARAMETERS, _MODULES)
        self.dicts: list[list[dict[str, object]]] = [[*map(get, modules)] for get in self.getters]
        self.flat = [*chain.from_iterable(self.dicts)]
        self.total = sum(map(len, self.flat))
        self.owners = [d for d in self.flat for _ in d]
        self.keys = [*chain.from_iterable(self.flat)]
        self.values = [*chain.from_iterable(map(dict.values, self.flat))]

    def unchanged(self) -> bool:
        """Each module still has its dicts (identity), every recorded key still
        maps to its object, and no key was added: with every recorded key
        present, an equal total count leaves no room for a new one."""
        return (
            all(all(map(operator.is_, map(get, self.modules), ds)) for get, ds in zip(self.getters, self.dicts))
            and sum(map(len, self.flat)) == self.total
            and all(map(operator.is_, map(dict.get, self.owners, self.keys, repeat(_ABSENT)), self.values))
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    """Rank-local storage of a tensor or DTensor (writes reach the original)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _describe_tensor(t: torch.Tensor) -> str:
    """dtype, rank-local shape and (for a DTensor) placements: everything about
    a tensor that shapes a collective or its meaning."""
    local = _local(t)
    placements = f" {tuple(t.placements)}" if isinstance(t, DTensor) else ""
    return f"{str(local.dtype).removeprefix('torch.')} {tuple(local.shape)}{placements}"


_MASK = (1 << 62) - 1


def _digest(text: str) -> int:
    """A 62-bit digest: it fits the agreement's int64 values."""
    return _digest_bytes(text.encode())


def _digest_bytes(data: bytes) -> int:
    """:func:`_digest` of raw bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & _MASK


@dataclass
class _Layout:
    """Everything one call derives from the model's structure, its marks, the
    TP group and ``max_bytes``: which tensors take part, in which order, how
    each is described to the peers, and the digest of all that.

    Rebuilt only when :meth:`valid` says the model or its marks changed, so
    the per-call cost is a few identity checks instead of a walk and a sort.
    Identity is not enough for the tensors themselves: a cast
    (``model.double()``), ``p.data = ...`` or ``swap_tensors`` keeps each
    Parameter object but changes what the descriptions and digest say and
    what a cached buffer was laid out for, so :meth:`valid` also compares
    every entry's rank-local dtype, shape and device, and each DTensor's
    placements and mesh, with what the layout was derived from.
    """

    key: tuple[object, ...]
    structure: _Structure
    entries: list[_Entry]
    descriptions: list[str]  # per entry: dtype, local shape, placements, mark
    local_dtypes: list[torch.dtype]
    local_shapes: list[torch.Size]
    local_devices: list[torch.device]
    placements: list[tuple[object, ...] | None]
    digest: int
    schedule: _Schedule | None = None  # the last call's bucket schedule, with its buffer
    # For the gradient fast path (see _grad_states): the entries' tensors,
    # the type a gradient laid out like its parameter has, the DTensor ones.
    tensors: list[torch.Tensor] = field(default_factory=list)
    grad_types: list[type] = field(default_factory=list)
    dtensors: list[int] = field(default_factory=list)
    dtensor_placements: list[tuple[object, ...]] = field(default_factory=list)
    dtensor_meshes: list[DeviceMesh] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tensors = [e.tensor for e in self.entries]
        self.grad_types = [DTensor if p is not None else torch.Tensor for p in self.placements]
        self.dtensors = [i for i, p in enumerate(self.placements) if p is not None]
        self.dtensor_placements = [p for p in self.placements if p is not None]
        self.dtensor_meshes = [self.tensors[i].device_mesh for i in self.dtensors]  # type: ignore[attr-defined]

    def valid(self, key: tuple[object, ...]) -> bool:
        return key == self.key and self.structure.unchanged() and self._tensors_unchanged()

    def placed_locals(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """``tensors`` (one per entry: the entries' own, or their gradients)
        as rank-local storage, when each at a DTensor entry's position has
        that entry's placements and mesh; else ``None``. C-level maps over
        all entries: a few microseconds instead of one Python iteration per
        entry."""
        if not self.dtensors:
            return tensors
        dt = [tensors[i] for i in self.dtensors]
        if [*map(_PLACEMENTS, dt)] != self.dtensor_placements:
            return None
        if not all(map(operator.is_, map(_MESH, dt), self.dtensor_meshes)):
            return None
        local = tensors[:]
        for i, t in zip(self.dtensors, map(_LOCAL_TENSOR, dt)):
            local[i] = t
        return local

    def _tensors_unchanged(self) -> bool:
        """Every entry still has the rank-local dtype, shape and device (and a
        DTensor the placements and mesh) the layout was derived from."""
        local = self.placed_locals(self.tensors)
        return (
            local is not None
            and [*map(_DTYPE, local)] == self.local_dtypes
            and [*map(_SHAPE, local)] == self.local_shapes
            and [*map(_DEVICE, local)] == self.local_devices
        )


_CACHE_ATTR = "_fsdptx_tp_layouts"


class _LayoutCache(dict[str, _Layout]):
    """Per-model cache of layouts, one per operation, and of the last TP
    context, kept in the first model part's ``__dict__`` so it lives and
    dies with the model. Copies and pickles of the model start with an
    empty cache rather than carrying tensors and buffers of this one."""

    context: _RememberedContext | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> _LayoutCache:
        return _LayoutCache()

    def __reduce__(self) -> tuple[type[_LayoutCache], tuple[()]]:
        return (_LayoutCache, ())


def _cache_of(part: nn.Module) -> _LayoutCache | None:
    cache = part.__dict__.get(_CACHE_ATTR)
    return cache if isinstance(cache, _LayoutCache) else None


def _derive_layout(
    parts: list[nn.Module],
    ctx: _TPContext,
    max_bytes: int,
    op: str,
    with_buffers: bool,
    key: tuple[object, ...],
    honour_exclusions: bool,
) -> _Layout:
    """The layout of ``parts`` for ``op``, from a fresh walk: the plain
    function the cache (:func:`_layout`) stands in front of."""
    params, buffers, modules = _walk(parts, honour_exclusions=honour_exclusions)
    replicated = ctx.replicated()
    entries = [e for e in (*params, *buffers) if replicated(e.tensor)] if with_buffers else [
        e for e in params if replicated(e.tensor)
    ]
    descriptions = [
        f"{_describe_tensor(e.tensor)} {e.reduction}" if not with_buffers else _describe_tensor(e.tensor)
        for e in entries
    ]
    text = "\n".join(f"{e.fqn} {d}" for e, d in zip(entries, descriptions))
    return _Layout(
        key=key,
        structure=_Structure(modules, with_buffers),
        entries=entries,
        descriptions=descriptions,
        local_dtypes=[_local(e.tensor).dtype for e in entries],
        local_shapes=[_local(e.tensor).shape for e in entries],
        local_devices=[_local(e.tensor).device for e in entries],
        placements=[tuple(e.tensor.placements) if isinstance(e.tensor, DTensor) else None for e in entries],
        digest=_digest(f"{op} max_bytes={max_bytes}\n{text}"),
    )


def _layout(
    parts: list[nn.Module],
    ctx: _TPContext,
    max_bytes: int,
    op: str,
    with_buffers: bool,
    *,
    honour_exclusions: bool = True,
) -> _Layout:
    """:func:`_derive_layout`, cached per ``op`` on the first model part and
    rebuilt when anything it was derived from changed; with caches off
    (:func:`fsdptx.caches`), derived afresh, stored nowhere, and any stored
    layout left untouched."""
    # The group by name, never the object (see _RememberedContext).
    key = (op, tuple(map(id, parts)), ctx.group_name, ctx.ranks, max_bytes, marks_generation(), honour_exclusions)
    if not caches_enabled():
        return _derive_layout(parts, ctx, max_bytes, op, with_buffers, key, honour_exclusions)
    cache = _cache_of(parts[0])
    if cache is None:
        cache = _LayoutCache()
        parts[0].__dict__[_CACHE_ATTR] = cache
    found = cache.get(op)
    if found is not None and found.valid(key):
        return found
    cache.pop(op, None)  # release the old schedule's buffer before building anew
    layout = cache[op] = _derive_layout(parts, ctx, max_bytes, op, with_buffers, key, honour_exclusions)
    return layout


def _context_cache(parts: list[nn.Module]) -> _LayoutCache | None:
    """Where :func:`_tp_context` remembers the TP context: the model's cache,
    or nowhere while the cache is off."""
    return _cache_of(parts[0]) if caches_enabled() else None


# ----------------------------------------------------------------------------
# Schedules: chunks, groups and one reusable buffer, for a given set of tensors.


@dataclass
class _Chunk:
    """One collective: ``slots`` say which tensor (or slice of one, for a
    tensor cut across chunks) fills which span of the buffer."""

    slots: list[int | tuple[int, int, int]]  # tensor index, or (index, start, stop) of its flat view
    spans: list[tuple[int, int, torch.Size | None]]  # per slot: buffer offset, numel, shape (None: flat)
    numel: int
    mean_numel: int  # the first ``mean_numel`` elements hold mean-reduced values
    views: list[torch.Tensor] = field(default_factory=list)  # per slot, once the buffer exists
    whole: list[int] | None = None  # the tensor indices when no slot is a slice (the common case)
    data: torch.Tensor | None = None
    mean: torch.Tensor | None = None


@dataclass
class _Group:
    device: torch.device
    dtype: torch.dtype
    has_mean: bool
    chunks: list[_Chunk]
    divisor: torch.Tensor | None = None  # one buffer element past every chunk's data (see _mean_factor)


@dataclass
class _Schedule:
    """How the tensors of one call travel: per (device, communication dtype)
    group, the chunks and their views of one buffer per device.

    The buffer is made (:meth:`materialize`) by the first call with this
    schedule, around its agreement (see :func:`_overlapped_agreement`), and kept
    with the schedule once a call succeeded, so repeated calls with the same
    layout reuse it (and pack their first chunk while the agreement is in
    flight): no allocation, no page faults, no per-tensor views. Its size is
    the largest chunk plus, for a group with means, one element for the
    divisor, within ``max_bytes``: all the extra memory the call needs, held
    until the layout changes or the model is released.
    """

    key: bytes
    groups: list[_Group]
    materialized: bool = False
    synced: list[int] = field(default_factory=list)  # sync: entries with a gradient to reduce
    call_digest: int = 0  # the agreement's per-call digest, a function of ``key``
    storages: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # the buffer, per device

    def buffer_bytes(self, device: torch.device) -> int:
        """The size of this schedule's buffer on ``device`` (0: none there)."""
        return max(
            ((max(c.numel for c in g.chunks) + g.has_mean) * g.dtype.itemsize for g in self.groups
             if g.device == device),
            default=0,
        )

    def agreement_slot(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer on ``device`` (the caller checks
        it has them) as the agreement's int64 values; only before anything
        is packed."""
        return self.storages[device][:nbytes].view(torch.int64)

    def materialize(self) -> None:
        if self.materialized:
            return
        devices = dict.fromkeys(g.device for g in self.groups)
        storages = {d: torch.empty(self.buffer_bytes(d), dtype=torch.uint8, device=d) for d in devices}
        self.storages = storages
        for g in self.groups:
            storage = storages[g.device]
            typed = storage[: storage.numel() // g.dtype.itemsize * g.dtype.itemsize].view(g.dtype)
            capacity = max(c.numel for c in g.chunks)
            g.divisor = typed[capacity : capacity + 1] if g.has_mean else None
            for c in g.chunks:
                c.views = [
                    typed[o : o + n] if shape is None else typed[o : o + n].view(shape) for o, n, shape in c.spans
                ]
                c.data = typed[: c.numel]
                c.mean = typed[: c.mean_numel] if c.mean_numel else None
        self.materialized = True


def _schedule(
    key: bytes,
    shapes: list[torch.Size],
    dtypes: list[torch.dtype],
    devices: list[torch.device],
    means: list[bool],
    comm_dtype: Callable[[torch.dtype], torch.dtype],
    max_bytes: int,
    where: str,
    names: list[str],
) -> _Schedule:
    """Lay the tensors out in chunks of at most ``max_bytes`` (no memory yet).

    Per (device, communication dtype), mean-reduced tensors come first and
    sum-reduced ones after, each in the given (rank-stable) order, so every
    chunk's means form one prefix and the division is one op per chunk
    rather than one per tensor. Chunks are :func:`gradient_chunks` of
    shape-only ("meta") stand-ins, so the layout is exactly what that
    function promises. A group with means budgets one element of
    ``max_bytes`` for the divisor. Raises ``ValueError`` (before any
    collective) when ``max_bytes`` cannot hold one element plus the divisor.
    """
    order: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for want_mean in (True, False):
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
            if means[i] == want_mean and shape.numel():  # empty tensors have nothing to communicate
                order.setdefault((devices[i], comm_dtype(dtype)), []).append(i)
    groups: list[_Group] = []
    for (device, dtype), members in order.items():
        has_mean = means[members[0]]
        reserve = dtype.itemsize if has_mean else 0
        if max_bytes < dtype.itemsize + reserve:
            offenders = [names[i] for i in members][:5]
            raise ValueError(
                f"{where}: max_bytes={max_bytes} cannot hold one {dtype} element"
                + (" plus the mean's divisor" if reserve else "")
                + f" (needs {dtype.itemsize + reserve} bytes) for {offenders}; raise max_bytes. "
                "Nothing was communicated or modified."
            )
        stand_ins = [torch.empty(shapes[i], dtype=dtypes[i], device="meta") for i in members]
        index_of = {id(t): i for t, i in zip(stand_ins, members)}
        chunks: list[_Chunk] = []
        for pieces in gradient_chunks(stand_ins, max_bytes - reserve):
            slots: list[int | tuple[int, int, int]] = []
            spans: list[tuple[int, int, torch.Size | None]] = []
            offset = mean_numel = 0
            for piece in pieces:
                whole = id(piece) in index_of
                i = index_of[id(piece) if whole else id(piece._base)]
                n = piece.numel()
                if whole:
                    slots.append(i)
                    spans.append((offset, n, shapes[i]))
                else:
                    start = int(piece.storage_offset())
                    slots.append((i, start, start + n))
                    spans.append((offset, n, None))
                offset += n
                if means[i]:
                    mean_numel = offset
            whole_slots = slots if all(isinstance(slot, int) for slot in slots) else None
            chunks.append(_Chunk(slots, spans, offset, mean_numel, whole=whole_slots))  # type: ignore[arg-type]
        groups.append(_Group(device, dtype, has_mean, chunks))
    return _Schedule(key, groups)


def _execute(
    schedule: _Schedule,
    tensors: list[torch.Tensor],
    collective: Callable[[torch.Tensor], None],
    divisor: float,
    agree: Callable[[], Callable[[], None]],
) -> None:
    """Run ``schedule`` on ``tensors`` in place: per chunk, one foreach copy in
    (casting low precision up), one collective, one op turning the mean
    prefix's sums into means (see :func:`_mean_factor`), one foreach copy
    out (casting back).

    ``agree()`` starts the agreement and returns what waits for its result
    (raising on disagreement); see :func:`_overlapped_agreement`. The first
    chunk is packed in between: packing writes only the schedule's own buffer,
    so the agreement's latency overlaps the copy in, and a disagreement
    still raises before any collective on the data and before any tensor
    is written.

    A slice of a non-contiguous tensor (rare for gradients) goes through a
    contiguous copy of that tensor, made once and written back at the end:
    the one allocation outside ``max_bytes``.
    """
    factor, multiply = _mean_factor(divisor)
    finish: Callable[[], None] | None = agree()
    try:
        staged: dict[int, torch.Tensor] = {}
        for group in schedule.groups:
            if group.divisor is not None:
                group.divisor.fill_(factor)  # another dtype's group may have overwritten it
            for chunk in group.chunks:
                if chunk.whole is not None:
                    sources = [tensors[i] for i in chunk.whole]
                else:
                    sources = []
                    for slot in chunk.slots:
                        if isinstance(slot, int):
                            sources.append(tensors[slot])
                            continue
                        i, start, stop = slot
                        t = tensors[i]
                        if not t.is_contiguous():
                            found = staged.get(i)
                            if found is None:  # copied once, not once per chunk it spans
                                found = staged[i] = t.contiguous()
                            t = found
                        sources.append(t.view(-1)[start:stop])
                torch._foreach_copy_(chunk.views, sources)
                if finish is not None:
                    done, finish = finish, None
                    done()
                collective(chunk.data)  # type: ignore[arg-type]
                if chunk.mean is not None:
                    if multiply:
                        chunk.mean.mul_(group.divisor)  # type: ignore[arg-type]
                    else:
                        chunk.mean.div_(group.divisor)  # type: ignore[arg-type]
                torch._foreach_copy_(sources, chunk.views)
        for i, work in staged.items():
            tensors[i].copy_(work)
    finally:
        if finish is not None:  # nothing to pack, or packing raised: still complete the agreement
            finish()


def _mean_factor(divisor: float) -> tuple[float, bool]:
    """What the buffer's divisor slot holds and whether the mean prefix is
    multiplied by it (else divided).

    For a group size that is a power of two (every TP size in practice) the
    reciprocal is exact, and multiplying by it gives the correctly rounded
    quotient, bit for bit what dividing gives, at half the cost of a
    division on CPU. Other sizes divide. The factor travels in the buffer,
    not as a Python scalar, because a scalar operand becomes a tensor the
    allocator makes on every call, outside ``max_bytes``.
    """
    if math.frexp(divisor)[0] == 0.5:
        return 1.0 / divisor, True
    return divisor, False


# ----------------------------------------------------------------------------
# The agreement.


_AGREEMENT_FIELDS = 4  # per rank: entry count, layout digest, call digest, any sparse (see _agree)


def _agreement_bytes(group_size: int) -> int:
    """The agreement's int64 values: this rank's fields once per peer (what
    it sends), then every peer's (what it receives)."""
    return 2 * group_size * _AGREEMENT_FIELDS * 8


def _no_wait() -> None:
    return None


def _overlapped_agreement(
    schedule: _Schedule, start: Callable[[torch.Tensor | None], Callable[[], None]], ctx: _TPContext
) -> Callable[[], Callable[[], None]]:
    """What :func:`_execute` calls to agree.

    When the schedule's buffer already exists (a repeated call), that is
    ``start`` with a small tensor of its own, so the first chunk is packed
    while the agreement is in flight. Otherwise the agreement runs to the
    end first, in a call whose peak extra memory must stay within
    ``max_bytes``: the buffer is made first and the agreement's values
    travel in its head, which nothing uses until the agreement is over. A
    separate agreement tensor would not do even if freed before the buffer
    is made: the process group's worker thread may hold the last reference
    to it a little longer. Only a buffer too small for the agreement's
    values (a budget or gradients of a few dozen bytes per TP rank) falls
    back to that: agreement first, buffer after.
    """
    if schedule.materialized:
        return lambda: start(None)
    need = _agreement_bytes(len(ctx.ranks))
    if schedule.buffer_bytes(ctx.device) >= need:
        schedule.materialize()
        start(schedule.agreement_slot(ctx.device, need))()
    else:
        start(None)()
        schedule.materialize()
    return lambda: _no_wait


def _call_digest(states: bytes, deviations: list[str]) -> int:
    """The agreement's digest of one call's gradient states and deviations."""
    return _digest(states.hex() + "\n".join(deviations)) if states or deviations else 0


def _agree(
    where: str,
    ctx: _TPContext,
    layout: _Layout,
    max_bytes: int,
    call_digest: int,
    states: bytes,
    deviations: list[str],
    sparse: list[str],
    slot: torch.Tensor | None,
) -> Callable[[], None]:
    """Start checking, with one small collective, that every TP peer is
    about to run the same collectives on the same things; return what
    finishes the check: it waits and raises the same ``RuntimeError`` on
    every peer if not. Nothing may be written or communicated in between
    but the caller's private buffer.

    Each rank sends its fields (entry count, layout digest, per-call
    digest, any sparse) to every peer in one all-to-all, so every peer holds
    every peer's fields (an all-gather). The layout digest (cached) covers
    every entry's FQN, dtype, rank-local shape, placements and mark and
    ``max_bytes``, hence the chunk layout; the per-call digest covers each
    gradient's presence and any way it departs from its parameter. Every
    peer sees the same rows and so takes the same branch: none can wait in
    a collective another skipped. Only on disagreement does a second
    collective (an all-gather of each rank's description) name the
    offenders. On a fake process group every received row is the local
    one, so peers always agree there and only local checks (sparsity) fire.

    Why an all-to-all: the agreement's latency is most of what a call adds
    to its data's own collectives. Measured on gloo (CPU, two and four
    ranks), an all-to-all of the fields took about half the latency of a
    MAX all-reduce of the fields and their negations (the obvious way to
    get every peer's minimum and maximum), and unlike an all-gather, which
    sits in between, it writes its output in place: gloo's all-gather
    allocates staging tensors that ``max_bytes`` does not cover.

    The values go into ``slot`` when given (see :func:`_overlapped_agreement`)
    by scalar fills and an in-place broadcast copy, which allocate nothing,
    whereas building a tensor from them to copy in would. The received rows
    start zeroed either way, so nothing inspecting the collective's
    arguments sees stale buffer bytes.
    """
    local = [len(layout.entries), layout.digest, call_digest, int(bool(sparse))]
    size = len(ctx.ranks)
    half = size * _AGREEMENT_FIELDS
    if slot is None:
        values = torch.tensor(local * size + [0] * half, dtype=torch.int64, device=ctx.device)
    else:
        values = slot
        for i, v in enumerate(local):
            values[i].fill_(v)
        values[:half].view(size, _AGREEMENT_FIELDS)[1:].copy_(values[:_AGREEMENT_FIELDS])
        values[half:].zero_()
    received = values[half:]
    work = dist.all_to_all_single(received, values[:half], group=ctx.group, async_op=True)

    def finish() -> None:
        work.wait()
        rows = received.view(size, _AGREEMENT_FIELDS).tolist()
        if all(row[:3] == rows[0][:3] for row in rows):
            if any(row[3] for row in rows):
                raise RuntimeError(_sparse_message(where, sparse))
            return
        mine = _Description(
            max_bytes,
            {e.fqn: d for e, d in zip(layout.entries, layout.descriptions)},
            {e.fqn: _STATE_NAMES[s] for e, s in zip(layout.entries, states)},
            dict(d.split("\0", 1) for d in deviations),
            sparse,
        )
        found: list[_Description | None] = [None] * size
        dist.all_gather_object(found, mine, group=ctx.group)
        raise RuntimeError(_disagreement_message(where, ctx.ranks, found))  # type: ignore[arg-type]

    return finish


# Per-entry gradient states of one call (one byte each).
_NO_GRAD, _SYNC, _SPARSE, _SKIP = 0, 1, 2, 3
_STATE_NAMES = {_NO_GRAD: "no grad", _SYNC: "grad", _SPARSE: "sparse grad", _SKIP: "grad not TP-replicated"}


@dataclass(frozen=True)
class _Description:
    """What a rank was about to do, for naming the differences."""

    max_bytes: int
    entries: dict[str, str]
    states: dict[str, str]
    grads: dict[str, str]  # grads that differ from their parameter: dtype, shape, placements
    sparse: list[str]


def _sparse_message(where: str, fqns: list[str]) -> str:
    return (
        f"{where}: sparse gradients on TP-replicated parameters {fqns} (on at least one TP peer) "
        "cannot be flattened into a reduction buffer; use dense gradients for them (e.g. "
        "nn.Embedding(sparse=False)) or exclude their module with exclude_from_tp_replica_sync. "
        "No gradient was modified."
    )


def _disagreement_message(where: str, ranks: tuple[int, ...], found: list[_Description]) -> str:
    """One message, the same on every peer, naming every difference."""
    sparse = sorted({f for d in found for f in d.sparse})
    if sparse:
        return _sparse_message(where, sparse)
    lines: list[str] = []
    sizes = [d.max_bytes for d in found]
    if len(set(sizes)) > 1:
        lines.append("max_bytes: " + ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, sizes)))
    fqns = sorted({f for d in found for f in d.entries})
    presence: list[str] = []
    for fqn in fqns:
        entry = [d.entries.get(fqn, "absent") for d in found]
        if len(set(entry)) > 1:
            lines.append(f"{fqn}: " + ", ".join(f"rank {r}: {e}" for r, e in zip(ranks, entry)))
            continue
        state = [d.states.get(fqn, "absent") for d in found]
        grad = [d.grads.get(fqn, "") for d in found]
        if len(set(state)) > 1 and set(state) <= {"no grad", "grad"}:
            presence.append(fqn)
        elif len(set(state)) > 1 or len(set(grad)) > 1:
            lines.append(
                f"{fqn} gradient: " + ", ".join(f"rank {r}: {s} {g}".rstrip() for r, s, g in zip(ranks, state, grad))
            )
    if presence and not lines:
        return (
            f"{where}: gradient presence differs across TP peers {list(ranks)} for {presence}: some "
            "peers have a gradient and others None. Reducing anyway would hang the peers that skip "
            "the collective. Make every TP rank run the same modules (or zero-fill unused "
            "gradients) before synchronizing. No gradient was modified."
        )
    if presence:
        lines.append(f"gradient present on some peers only: {presence}")
    return (
        f"{where}: TP peers {list(ranks)} disagree on what to communicate:\n  "
        + "\n  ".join(lines)
        + "\nEvery TP rank must pass the same model parts (same parameters, shapes, dtypes, "
        "placements, reduction marks and exclusions) and the same max_bytes. Nothing was "
        "communicated or modified."
    )


# ----------------------------------------------------------------------------
# Public operations.


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
    placements. Excluded, TP-sharded and TP-partial tensors are untouched.

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

    Returns the number of rank-local gradients synchronized (tied once);
    0 and no collective without a TP axis of size > 1.

    Args:
        model_parts: the model, or the model parts this rank holds, in the
            same order on every rank.
        device_mesh: the mesh the model was parallelized on (``None``: no
            mesh, nothing to do).
        tp_axis_name: the mesh dim name of tensor parallelism.
        max_bytes: the most bytes one communication buffer may take.

    Returns:
        How many rank-local gradients were synchronized (tied ones once).

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
    layout = _layout(parts, ctx, max_bytes, "sync", with_buffers=False)
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
            local, same = (g._local_tensor, False) if isinstance(g, DTensor) else (g, True)
        elif isinstance(g, DTensor):
            local = g._local_tensor
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
