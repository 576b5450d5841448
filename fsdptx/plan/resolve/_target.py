"""Planning one target module (a block, or the root): the survey of its
subtree, the descent that splits a subtree mixing dtypes, and
:func:`_plan_target`.

The messages for an unplannable module sit here too, since
:func:`_plan_target` and :func:`_split_children` raise them. Block replay
(:mod:`._replay`) replays what :func:`_plan_target` planned; cross-block
units (:mod:`._cross_block`) use :func:`_split_children` for a holder's
children.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ...core._tree import _EMPTY, _MIXED, join_fqn, subtree_keys
from ...model._index import ModelIndex, PlanningError
from ...model._unit_checks import is_container
from .._types import UnitKind
from ._claim import _survey, claim
from ._keys import DtypeKey
from ._resolver import _Resolver

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
