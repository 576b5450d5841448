"""The resolver: the per-resolution state (:class:`_Resolver`) and the dtype
planner it runs on one target module.

Everything the other files of :mod:`fsdptx.plan.resolve` build on lives
here: what ``fully_shard`` would claim (:func:`claim`), each parameter's
(storage, compute) key (:func:`param_keys`), the unit policies, the survey of
a target's subtree, the descent that splits a subtree mixing dtypes, and
:func:`_plan_target`, which plans one block or the root. The messages for an
unplannable module sit here too, since :func:`_plan_target` and
:func:`_split_children` raise them. It imports no other file of the package.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ...core._caches import memoized
from ...core._dtypes import LOW_PRECISION_FLOATS, resolve_compute_dtype, token_search
from ...core._policy import get_internal_fsdp_mp_policy, keep_storage_policy, mp_policy_with_param_dtype
from ...core._tree import _EMPTY, _MIXED, join_fqn, subtree_keys
from ...model._index import ModelIndex, PlanningError
from ...model._unit_checks import is_container
from .._types import Unit, UnitKind

__all__ = ["DtypeKey", "claim", "low_precision_bulk", "param_keys", "unit_policy"]


DtypeKey = tuple[torch.dtype, torch.dtype]  # (storage, compute)


def claim(
    index: ModelIndex, roots: Sequence[nn.Module], stop: set[int]
) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``fully_shard(roots)`` would manage, before ignoring any:
    direct parameters of every module reachable from ``roots`` without entering
    a module already sharded (``stop``). Each tied parameter once."""
    if len(roots) == 1:
        return _survey(index, roots[0], stop)[2]
    if not index.shared_modules and not index.aliases:
        disjoint = _disjoint_leaves(index, roots)
        if disjoint is not None:
            return disjoint
    return _first_occurrences([item for r in roots for item in _survey(index, r, stop)[2]])


def _disjoint_leaves(index: ModelIndex, roots: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]] | None:
    """:func:`claim` of ``roots`` that are distinct leaves of a tree without
    ties (a cross-block unit's holders), read from their slot ranges: a
    leaf's claim is its direct parameters, and distinct leaves share none.
    ``None`` when some root has submodules or appears twice."""
    position, end = index.walk.position, index.subtree_end
    at = list(map(position.__getitem__, map(id, roots)))
    if len(set(at)) != len(at) or any(end[i] != i + 1 for i in at):
        return None
    start, fqns, params = index.slot_start, index.slot_fqn, index.walk.params
    claimed: list[tuple[str, nn.Parameter]] = []
    for i in at:
        a, b = start[i], start[i + 1]
        if a < b:
            claimed.extend(zip(fqns[a:b], params[a:b]))
    return claimed


def _first_occurrences(claimed: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """Keep each parameter once: FSDP manages a parameter reached twice once."""
    seen: set[int] = set()
    out = []
    for f, p in claimed:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((f, p))
    return out


@dataclass
class _Resolver:
    """Mutable scratch state for one resolution; never escapes ``resolve_units``."""

    index: ModelIndex
    mp_policy: MixedPrecisionPolicy | None
    offload_policy: OffloadPolicy | None
    excluded: set[int]  # params owned elsewhere or ignored: never grouped, never claimed
    sharded: set[int]  # modules that are, or will be by then, FSDP modules
    keys: dict[int, DtypeKey] = field(default_factory=dict)  # floating params' (storage, compute)
    frozen: set[int] = field(default_factory=set)  # floating params without requires_grad
    intrinsic: set[int] = field(default_factory=set)  # fp32 params computing fp32 because the bulk is lower precision
    bulk: torch.dtype | None = None  # that bulk's storage dtype, for the units' reasons
    ignored: set[int] = field(default_factory=set)  # the request's ignored params
    ignored_under: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> ignored params below
    units: list[Unit] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)  # param id -> unit index

    def __post_init__(self) -> None:
        # Read once per resolution: with caches off, every read of the
        # index's table computes it again, and this runs for every unit.
        self.facts = self.index.param_facts
        # Thousands of units share a handful of policies.
        self.policy_for: Callable[[tuple[torch.dtype | None, bool]], MixedPrecisionPolicy | None] = memoized(
            functools.partial(unit_policy, self.mp_policy)
        )

    def policy(self, compute: torch.dtype | None, internal: bool) -> MixedPrecisionPolicy | None:
        """The policy for a unit computing in ``compute`` (:func:`unit_policy`)."""
        return self.policy_for((compute, internal))

    def add(
        self,
        modules: Sequence[nn.Module],
        kind: UnitKind,
        policy: MixedPrecisionPolicy | None,
        reshard: bool | int | None,
        claimed: list[tuple[str, nn.Parameter]] | None = None,
        also_ignored: Collection[str] = (),
    ) -> Unit:
        """Record a unit owning what ``fully_shard(modules)`` would claim now
        (``claimed``, when the caller has just computed it).

        Its dtypes are those of its trainable parameters (frozen ones ride
        along: FSDP2 only asks trainable parameters to agree). Its ignored
        parameters are those it reaches, plus ``also_ignored``: the ignored
        parameters below units nested in it by the same request, which the
        seed forwards to the enclosing unit.
        """
        if claimed is None:
            claimed = claim(self.index, modules, self.sharded)
        here = [self.index.fqn_of(m) for m in modules]
        excluded, owner, position, keys, frozen = self.excluded, self.owner, len(self.units), self.keys, self.frozen
        facts = self.facts
        params: list[str] = []
        ignored: set[str] = set()
        unit_keys: set[DtypeKey] = set()
        frozen_keys: set[DtypeKey] = set()
        numel = nbytes = 0
        for f, p in claimed:  # one pass: this runs for every unit of the plan
            pid = id(p)
            if pid in excluded:
                earlier = owner.get(pid)
                if earlier is not None:
                    raise PlanningError(
                        f"parameter {f!r} is shared (also named {self.index.names(p)[1:]}) and would "
                        f"belong to two FSDP units: {list(self.units[earlier].modules)[:3]} and {here[:3]}. "
                        "FSDP2 needs a shared parameter inside one unit: shard a common ancestor as "
                        "one unit (e.g. leave it to the root), or untie the parameter"
                    )
                ignored.add(f)
                continue
            params.append(f)
            key = keys.get(pid)
            if key is not None:
                (frozen_keys if pid in frozen else unit_keys).add(key)
            _dtype, n, b, _hint, _grad = facts[pid]
            numel += n
            nbytes += b
            excluded.add(pid)
            owner[pid] = position
        ignored.update(also_ignored)
        params.sort()  # FQN order: a unit is a set, and its listing must not
        unit_keys = unit_keys or frozen_keys  # depend on the order a rank registered modules in
        storage = {k[0] for k in unit_keys}
        compute = {k[1] for k in unit_keys}
        reasons: list[str] = []
        if self.intrinsic and any(id(p) in self.intrinsic for _f, p in claimed):
            reasons.append(f"fp32: intrinsic, {str(self.bulk).removeprefix('torch.')} bulk")
        if kind == "dtype" and compute == {torch.float32} and all(_is_leaf(m) for m in modules):
            # A parameter holder's forward may hand out its own parameter
            # (attention sinks that ignore their input): resharding after
            # forward would free the storage the caller still holds. Holders
            # are small, so they stay gathered, as the cross-block unit does.
            reshard = False
            reasons.append("gathered: holder may return its parameter")
        unit = Unit(
            modules=tuple(here),
            params=tuple(params),
            ignored_params=tuple(sorted(ignored)),
            kind=kind,
            storage_dtype=storage.pop() if len(storage) == 1 else None,
            compute_dtype=compute.pop() if len(compute) == 1 else None,
            mp_policy=policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=reshard,
            numel=numel,
            nbytes=nbytes,
            reasons=tuple(reasons),
        )
        self.units.append(unit)
        self.sharded.update(id(m) for m in modules)
        return unit

    def ignore(self, fqns: Sequence[str]) -> None:
        """Exclude the named parameters from every unit and remember, for each
        module above one, which it may have to forward as ``ignored_params``."""
        index = self.index
        for fqn in fqns:
            p = index.param_named(fqn)
            if p is None:
                raise PlanningError(f"shard_by_dtype: ignored parameter {fqn!r} is not a parameter of the model")
            self.excluded.add(id(p))
            self.ignored.add(id(p))
            canonical = index.param_fqn[id(p)]
            for name in index.names(p):
                module = name.rpartition(".")[0]
                while True:
                    self.ignored_under.setdefault(module, set()).add(canonical)
                    if not module:
                        break
                    module = module.rpartition(".")[0]


def unit_policy(
    mp_policy: MixedPrecisionPolicy | None, setting: tuple[torch.dtype | None, bool]
) -> MixedPrecisionPolicy | None:
    """The policy for a unit computing in ``compute`` under ``mp_policy``
    (``None``: ``mp_policy`` as is; a non-floating dtype: no cast at all);
    ``internal`` units drop ``output_dtype``."""
    compute, internal = setting
    if compute is not None and not compute.is_floating_point:
        # Integer, bool or complex parameters: nothing to cast, and a
        # bf16 (or fp32) cast would truncate them or drop the
        # imaginary part; they compute and reduce as they are stored.
        policy = keep_storage_policy(mp_policy)
    elif compute is None:
        policy = mp_policy
    else:
        policy = mp_policy_with_param_dtype(mp_policy, compute)
    return get_internal_fsdp_mp_policy(policy) if internal else policy


def low_precision_bulk(index: ModelIndex) -> torch.dtype | None:
    """The storage dtype of the model's trainable bulk (most trainable numel;
    all parameters when none is trainable) when it is a lower-precision
    float (bf16, fp16, fp8), else ``None``. In such a model an fp32
    parameter was kept fp32 on purpose and computes in fp32
    (:func:`fsdptx._dtypes.resolve_compute_dtype`, rule 4)."""
    trainable: dict[torch.dtype, int] = {}
    every: dict[torch.dtype, int] = {}
    for (dtype, grad), n in index.numel_by_kind.items():
        if not dtype.is_floating_point:
            continue
        every[dtype] = every.get(dtype, 0) + n
        if grad:
            trainable[dtype] = trainable.get(dtype, 0) + n
    counts = trainable or every
    if not counts:
        return None
    bulk = max(counts, key=lambda d: (counts[d], str(d)))  # a tie by name: every rank decides alike
    return bulk if bulk in LOW_PRECISION_FLOATS else None


def _is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` has no submodules: a plain parameter holder."""
    return not any(c is not None for c in module._modules.values())


def param_keys(
    index: ModelIndex, mp_policy: MixedPrecisionPolicy | None, fp32_tokens: Collection[str]
) -> tuple[dict[int, DtypeKey], set[int], set[int]]:
    """(storage, compute) dtype of every floating parameter, the ids of
    the frozen ones among them, and the ids of the fp32 parameters that
    compute in fp32 because the model's bulk is lower precision (not pinned,
    no hint: the rule decided, and the Plan says so).

    Resolved once from the facts the index recorded (no tensor is consulted
    again); parameters with equal facts share one resolution. Integer and
    bool parameters get no key: they cannot be trainable, so they constrain
    no unit and join whichever claims them. Complex ones are keyed by their
    storage (computing as stored).
    """
    search = token_search(tuple(fp32_tokens))
    low_bulk = low_precision_bulk(index) is not None
    key_of = memoized(functools.partial(_dtype_key, mp_policy=mp_policy, low_bulk=low_bulk))
    keys: dict[int, DtypeKey] = {}
    frozen: set[int] = set()
    intrinsic: set[int] = set()
    by_bulk: DtypeKey | None = None  # the key the bulk rule gives fp32 storage, if it decides one
    if low_bulk and mp_policy is not None:
        master = resolve_compute_dtype(torch.float32, False, None, mp_policy)
        if master != torch.float32:
            by_bulk = (torch.float32, torch.float32)
    aliases, param_fqn = index.aliases, index.param_fqn
    for pid, (dtype, _n, _b, hint, grad) in index.param_facts.items():
        pinned = search is not None and (
            search(param_fqn[pid]) is not None or (pid in aliases and any(map(search, aliases[pid])))
        )
        key = key_of((dtype, pinned, hint))  # a handful of distinct facts in a whole model
        if key is None:
            continue
        keys[pid] = key
        if by_bulk is not None and key == by_bulk and not pinned and not isinstance(hint, torch.dtype):
            intrinsic.add(pid)
        if not grad:
            frozen.add(pid)
    return keys, frozen, intrinsic


def _dtype_key(
    fact: tuple[torch.dtype, bool, object], *, mp_policy: MixedPrecisionPolicy | None, low_bulk: bool
) -> DtypeKey | None:
    """The (storage, compute) key of a parameter with these facts (storage
    dtype, pinned by a token, compute-dtype hint), or ``None`` for an
    integer or bool one. Complex parameters are trainable, so FSDP2 asks a
    unit to hold them alone like any storage dtype; their compute dtype is
    their storage (resolve_compute_dtype keeps every non-floating dtype)."""
    dtype, pinned, hint = fact
    if not (dtype.is_floating_point or dtype.is_complex):
        return None
    return (dtype, resolve_compute_dtype(dtype, pinned, hint, mp_policy, low_precision_bulk=low_bulk))


def _shardable(fqn: str, module: nn.Module, stop: Collection[int] = ()) -> Iterator[tuple[str, nn.Module]]:
    """A container cannot be a unit: shard its elements instead, except those
    already planned as units (``stop``): a container is uniform when its
    unsharded elements are, so it may hold elements sharded earlier."""
    if not is_container(module):
        yield fqn, module
        return
    for name, child in module._modules.items():
        if child is not None and id(child) not in stop:
            yield from _shardable(join_fqn(fqn, name), child, stop)


@dataclass
class _Survey:
    """What ``fully_shard(target)`` would reach, summarised for planning.

    ``direct`` is each module's own group: the (storage, compute) key of its
    trainable direct parameters, or, when it has none, of its frozen ones
    (the most numerous key, ties broken by name). Frozen parameters thus
    never make a module unplannable and never split one holding trainable
    parameters (they join its unit, computing in its dtype); they decide the
    group only of a module holding nothing trainable, so a frozen fp32 holder
    (a LoRA base model's sinks) still gets a unit computing in fp32.
    ``counts`` is parameters per group, each counted in its module's group.
    ``unsplittable`` lists the modules whose trainable direct parameters
    themselves mix groups, with those parameters. ``own`` is ``direct`` by
    position in ``order`` (``_EMPTY`` for none), ready to fold. ``order``
    holds walk positions (``index.walk.modules``), as :func:`_survey` gives.
    """

    order: list[int]
    parent: list[int]
    claimed: list[tuple[str, nn.Parameter]]
    own: list[object]
    direct: dict[int, DtypeKey]
    counts: dict[DtypeKey, int]
    unsplittable: list[tuple[nn.Module, list[tuple[str, DtypeKey]]]]


def _survey_target(r: _Resolver, target: nn.Module) -> _Survey:
    index = r.index
    order, parent, claimed = _survey(index, target, r.sharded)
    excluded, keys, frozen = r.excluded, r.keys, r.frozen
    modules, params, start, fqns = index.walk.modules, index.walk.params, index.slot_start, index.slot_fqn
    direct: dict[int, DtypeKey] = {}
    counts: dict[DtypeKey, int] = {}
    unsplittable: list[tuple[nn.Module, list[tuple[str, DtypeKey]]]] = []
    state: list[object] = []
    for i in order:
        own: DtypeKey | None = None
        mixed = False
        n = 0
        soft: dict[DtypeKey, int] | None = None
        for p in params[start[i] : start[i + 1]]:  # the module's direct parameters
            pid = id(p)
            k = keys.get(pid)
            if k is None or pid in excluded:
                continue
            n += 1
            if pid in frozen:
                if soft is None:
                    soft = {}
                soft[k] = soft.get(k, 0) + 1
            elif own is None:
                own = k
            elif own != k:
                mixed = True
        if mixed:
            listed = [
                (fqns[slot], keys[id(params[slot])])
                for slot in range(start[i], start[i + 1])
                if id(params[slot]) in keys and id(params[slot]) not in excluded and id(params[slot]) not in frozen
            ]
            unsplittable.append((modules[i], sorted(listed, key=lambda item: item[0])))
            state.append(_MIXED)
            continue
        if own is None and soft:
            own = min(soft, key=lambda k: (-soft[k], str(k)))
        if own is None:
            state.append(_EMPTY)
        else:
            state.append(own)
            direct[id(modules[i])] = own
            counts[own] = counts.get(own, 0) + n
    return _Survey(order, parent, claimed, state, direct, counts, unsplittable)


def _subtree_states(r: _Resolver, target: nn.Module, s: _Survey) -> dict[int, object]:
    """Each surveyed module's subtree as one group, ``_EMPTY`` or ``_MIXED``.

    On a tree (no module registered twice) the surveyed pre-order list is
    enough: children come after parents, so one backwards pass folds each
    module's group into its parent's. A model with shared modules takes the
    general walk of :func:`subtree_keys`, which sees a shared module from
    every parent.
    """
    direct = s.direct
    if r.index.shared_modules:
        states, _shared = subtree_keys(
            target, lambda m: (direct[id(m)],) if id(m) in direct else (), stop=r.sharded
        )
        return states
    order, parent, state = s.order, s.parent, s.own  # folded in place: the survey is used once
    for i in range(len(order) - 1, 0, -1):
        folded, up = state[i], parent[i]
        if folded is _EMPTY or state[up] is _MIXED:
            continue
        if state[up] is _EMPTY:
            state[up] = folded
        elif state[up] != folded:
            state[up] = _MIXED
    modules = r.index.walk.modules
    return {id(modules[i]): st for i, st in zip(order, state)}


@dataclass
class _Descent:
    """Plans the units below one module whose subtree mixes groups.

    Units come children before parents, siblings in name order (never
    registration order), so every rank plans alike.
    """

    r: _Resolver
    state: dict[int, object]
    direct: dict[int, DtypeKey]
    reshard: bool | int | None
    scope: set[str]  # the ignored params the surveyed region holds
    reached: set[int] = field(default_factory=set)  # params claimed by the units planned here

    def children(self, fqn: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        sharded = self.r.sharded
        return [
            (join_fqn(fqn, name), child)
            for name, child in sorted(module._modules.items())
            if child is not None and id(child) not in sharded
        ]

    def uniform(self, fqn: str, module: nn.Module, key: DtypeKey) -> None:
        """A uniform subtree: one unit (a container: one per element)."""
        r = self.r
        policy = r.policy(key[1], True)
        for _f, child in _shardable(fqn, module, r.sharded):
            claimed = claim(r.index, [child], r.sharded)
            self.reached.update(id(p) for _q, p in claimed)
            r.add([child], "dtype", policy, self.reshard, claimed)

    def isolate(self, fqn: str, module: nn.Module, minority: DtypeKey) -> None:
        """Two groups: every maximal minority subtree below ``module`` alone,
        the majority left to the target. A module holding minority parameters
        directly inside a mixed subtree is split (:meth:`split`)."""
        for cf, child in self.children(fqn, module):
            st = self.state.get(id(child), _EMPTY)
            if st is _MIXED:
                if self.direct.get(id(child)) == minority:
                    self.split(cf, child)
                    self.own(child)
                else:
                    self.isolate(cf, child, minority)
            elif st == minority:
                self.uniform(cf, child, minority)

    def split(self, fqn: str, module: nn.Module) -> None:
        """Give every parameter below ``module`` a unit below it, so that a
        unit of ``module`` then owns only its direct parameters: fully_shard
        stops at submodules already sharded.

        Below a holder (a module with direct parameters of its own, such as
        an attention module with fp32 sinks) the uniform children of one
        group share ONE multi-module unit: q/k/v/o projections are one
        all-gather and one reduce-scatter, not four. Elsewhere (the seed's
        3+ group rule) each maximal uniform subtree stays a unit of its own.
        """
        merged: dict[DtypeKey, list[nn.Module]] = {}
        holder = id(module) in self.direct
        for cf, child in self.children(fqn, module):
            st = self.state.get(id(child), _EMPTY)
            if st is _MIXED:
                self.split(cf, child)
                self.own(child)
            elif st is not _EMPTY and holder:
                merged.setdefault(st, []).extend(m for _f, m in _shardable(cf, child, self.r.sharded))  # type: ignore[arg-type]
            elif st is not _EMPTY:
                self.uniform(cf, child, st)  # type: ignore[arg-type]
        r = self.r
        for key, modules in merged.items():
            claimed = claim(r.index, modules, r.sharded)
            self.reached.update(id(p) for _q, p in claimed)
            r.add(modules, "dtype", r.policy(key[1], True), self.reshard, claimed)

    def own(self, module: nn.Module) -> None:
        """The unit of a split module, owning its direct parameters (and any
        key-less ones left below it). A module without direct parameters gets
        none: what is left below it goes to the enclosing unit."""
        key = self.direct.get(id(module))
        if key is None:
            return
        r = self.r
        claimed = claim(r.index, [module], r.sharded)
        self.reached.update(id(p) for _q, p in claimed)
        below = r.ignored_under.get(r.index.fqn_of(module), set()) & self.scope if self.scope else ()
        r.add([module], "dtype", r.policy(key[1], True), self.reshard, claimed, below)


def _plan_target(r: _Resolver, fqn: str, reshard: bool | int | None, is_root: bool) -> None:
    """Plan the dtype units of one target module (a block, or the root ``""``).

    1 (storage, compute) group -> the target alone; 2 groups -> every maximal
    subtree of the minority group alone, then the target with the majority;
    3+ -> every maximal uniform subtree alone, then the target when it holds
    parameters directly, must keep ignored ones, or is the root. Wherever a
    module holds one group directly but its subtree mixes groups (fp32
    ``sinks`` or ``A_log`` on a bf16 attention or mixer module), its children
    get units first and then it gets a unit owning only its direct
    parameters; the target too, when its direct parameters are the 2-group
    minority. Child units are internal (no ``output_dtype``); the target
    keeps the caller's boundary policy.
    """
    index = r.index
    target = index.module(fqn, "shard_by_dtype target")
    if id(target) in r.sharded:
        return
    kind: UnitKind = "root" if is_root else "block"
    s = _survey_target(r, target)
    if s.unsplittable:
        raise PlanningError(_unsplittable_message(r.index, s.unsplittable, fqn))
    if len(s.counts) <= 1:
        if s.claimed or is_root:
            only = next(iter(s.counts), None)
            if only is not None:
                compute: torch.dtype | None = only[1]
            elif s.claimed and not is_root:  # integer or bool parameters alone: no compute dtype
                compute = s.claimed[0][1].dtype
            else:
                compute = None
            r.add([target], kind, r.policy(compute, False), reshard, s.claimed)
        return

    descent = _Descent(r, _subtree_states(r, target, s), s.direct, reshard, _ignored_in(r, s))
    own = s.direct.get(id(target))
    if len(s.counts) == 2:
        # Fewest parameters is the minority; a tie is broken by the dtype
        # names, never by registration order, so every rank plans alike.
        counts = s.counts
        minority = min(counts, key=lambda k: (counts[k], str(k)))
        if own == minority:
            descent.split(fqn, target)
        else:
            descent.isolate(fqn, target, minority)
            own = next(k for k in counts if k != minority)
    else:
        descent.split(fqn, target)
    if index.tied:  # a tied parameter may be reachable both inside and outside a child
        rest = claim(index, [target], r.sharded)
    else:  # otherwise the target now reaches exactly what its children no longer leave it
        rest = [(f, p) for f, p in s.claimed if id(p) not in descent.reached]
    if own is not None or rest or is_root or descent.scope:
        r.add([target], kind, r.policy(own[1] if own else None, False), reshard, rest, descent.scope)


def _ignored_in(r: _Resolver, s: _Survey) -> set[str]:
    """The ignored parameters a survey reached: forwarded to its target's unit."""
    ignored = r.ignored
    return {f for f, p in s.claimed if id(p) in ignored} if ignored else set()


def _survey(
    index: ModelIndex, target: nn.Module, stop: set[int]
) -> tuple[list[int], list[int], list[tuple[str, nn.Parameter]]]:
    """What ``fully_shard(target)`` would reach: the walk positions of the
    modules in pre-order with each one's parent (an index into that list),
    and the claimed parameters (as :func:`claim`). The planner derives
    everything else from these lists instead of walking the subtree again.

    On a tree the reached modules are the target's pre-order range less the
    subtrees of modules in ``stop``, and their parameters the matching slot
    ranges: read from the index's lists alone, without touching a module
    (on a large model each touch is a likely cache miss). A model with
    shared modules takes :func:`_survey_shared`.
    """
    if index.shared_modules:
        return _survey_shared(index, target, stop)
    walk = index.walk
    modules, parents, end = walk.modules, walk.parents, index.subtree_end
    top = walk.position[id(target)]
    order = [top]
    parent = [-1]
    local = {top: 0}  # position -> index in order
    runs: list[tuple[int, int]] = []  # ranges of consecutive reached positions
    first, i, last = top, top + 1, end[top]
    while i < last:
        if id(modules[i]) in stop:
            runs.append((first, i))
            first = i = end[i]
            continue
        local[i] = len(order)
        order.append(i)
        parent.append(local[parents[i]])
        i += 1
    runs.append((first, last))
    start, fqns, params = index.slot_start, index.slot_fqn, walk.params
    claimed: list[tuple[str, nn.Parameter]] = []
    for a, b in runs:
        a, b = start[a], start[b]
        if a < b:
            claimed.extend(zip(fqns[a:b], params[a:b]))
    if index.aliases:
        claimed = _first_occurrences(claimed)
    return order, parent, claimed


def _survey_shared(
    index: ModelIndex, target: nn.Module, stop: set[int]
) -> tuple[list[int], list[int], list[tuple[str, nn.Parameter]]]:
    """:func:`_survey` on a model with shared modules: the walk recorded a
    shared module's subtree under its first parent only, so follow the
    modules' own ``_modules``, which list it under every parent."""
    param_fqn, position = index.param_fqn, index.walk.position
    order: list[int] = []
    parent: list[int] = []
    claimed: list[tuple[str, nn.Parameter]] = []
    stack: list[tuple[nn.Module, int]] = [(target, -1)]
    while stack:
        m, up = stack.pop()
        if m is not target and id(m) in stop:
            continue
        here = len(order)
        order.append(position[id(m)])
        parent.append(up)
        for p in m._parameters.values():
            if p is not None:
                claimed.append((param_fqn[id(p)], p))
        children = m._modules
        if children:
            stack.extend([(c, here) for c in reversed(children.values()) if c is not None])
    return order, parent, _first_occurrences(claimed)


def _dtype_pair(key: DtypeKey) -> str:
    return f"{str(key[0]).removeprefix('torch.')}->{str(key[1]).removeprefix('torch.')}"


def _unsplittable_message(
    index: ModelIndex, found: list[tuple[nn.Module, list[tuple[str, DtypeKey]]]], target: str
) -> str:
    modules = "; ".join(
        f"{index.fqn_of(m) or '<root>'} holds "
        + ", ".join(f"{f} ({_dtype_pair(k)})" for f, k in params)
        for m, params in found
    )
    return (
        f"cannot give every parameter of {target or '<root>'!r} a dtype-uniform FSDP unit: "
        f"trainable parameters of different (storage->compute) dtypes sit directly on one module "
        f"({modules}). fully_shard claims all direct parameters of a module together, and a unit "
        "needs one storage dtype and computes in one dtype. Split the module: move the parameters "
        "of one dtype into a submodule of their own, or give them one storage dtype."
    )


def _non_fp32(r: _Resolver, claimed: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The trainable claimed parameters not stored in fp32 (frozen ones ride along)."""
    return [
        (f, p)
        for f, p in claimed
        if p.dtype != torch.float32 and p.requires_grad and id(p) not in r.excluded
    ]


def _split_children(r: _Resolver, holder: nn.Module, reshard: bool | int | None) -> set[str]:
    """Dtype units for everything below ``holder``, so that a unit of it then
    owns only its direct parameters; returns the ignored parameters below it,
    for that unit to forward."""
    s = _survey_target(r, holder)
    fqn = r.index.fqn_of(holder)
    if s.unsplittable:
        raise PlanningError(_unsplittable_message(r.index, s.unsplittable, fqn))
    descent = _Descent(r, _subtree_states(r, holder, s), s.direct, reshard, _ignored_in(r, s))
    descent.split(fqn, holder)
    return descent.scope
