"""The layout of one TP-replica operation: which tensors take part, in
which rank-stable order, how each is described to the peers, and the digest
of all that, derived by one walk of the model (:func:`_derive_layout`) and
kept on the model between calls (:func:`_layout`) while nothing it was
derived from changed. Off inside ``fsdptx.caches(enabled=False)``."""

from __future__ import annotations

import hashlib
import operator
import weakref
from dataclasses import dataclass, field
from itertools import chain, repeat
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from ...core._caches import caches_enabled
from ...core._torch_internals import local_tensor
from .._marks import is_excluded_from_tp_replica_sync, marks_generation, module_reductions
from ...plan._types import Reduction
from ...core._tree import rank_stable_unique
from ._context import _RememberedContext, _TPContext, _device
from ._schedule import _Schedule

__all__ = []


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
    return local_tensor(t) if isinstance(t, DTensor) else t


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
        for i, t in zip(self.dtensors, map(local_tensor, dt)):
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
    dtensor_axis: str | None = None,
) -> _Layout:
    """The layout of ``parts`` for ``op``, from a fresh walk: the plain
    function the cache (:func:`_layout`) stands in front of. With a
    ``dtensor_axis`` (the TP dim's name), the replicas DTensor keeps alike
    itself along it are left out (:meth:`_TPContext.dtensor_keeps`): the
    gradient sync's choice."""
    params, buffers, modules = _walk(parts, honour_exclusions=honour_exclusions)
    replicated = ctx.replicated()
    if dtensor_axis is not None:
        kept, any_replica = ctx.dtensor_keeps(dtensor_axis), replicated
        replicated = lambda t: any_replica(t) and not kept(t)  # noqa: E731
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
    dtensor_axis: str | None = None,
) -> _Layout:
    """:func:`_derive_layout`, cached per ``op`` on the first model part and
    rebuilt when anything it was derived from changed; with caches off
    (:func:`fsdptx.caches`), derived afresh, stored nowhere, and any stored
    layout left untouched."""
    # The group by name, never the object (see _RememberedContext).
    key = (
        op, tuple(map(id, parts)), ctx.group_name, ctx.ranks, max_bytes, marks_generation(), honour_exclusions,
        dtensor_axis, with_buffers,
    )
    if not caches_enabled():
        return _derive_layout(parts, ctx, max_bytes, op, with_buffers, key, honour_exclusions, dtensor_axis)
    cache = _cache_of(parts[0])
    if cache is None:
        cache = _LayoutCache()
        parts[0].__dict__[_CACHE_ATTR] = cache
    found = cache.get(op)
    if found is not None and found.valid(key):
        return found
    cache.pop(op, None)  # release the old schedule's buffer before building anew
    layout = cache[op] = _derive_layout(
        parts, ctx, max_bytes, op, with_buffers, key, honour_exclusions, dtensor_axis
    )
    return layout


def _context_cache(parts: list[nn.Module]) -> _LayoutCache | None:
    """Where :func:`_tp_context` remembers the TP context: the model's cache,
    or nowhere while the cache is off."""
    return _cache_of(parts[0]) if caches_enabled() else None
