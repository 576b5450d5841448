"""Block replay: the optional fast path of dtype planning.

Real models repeat one block class many times; :class:`_BlockReplay` plans
the first block of a shape in full (:func:`~._resolver._plan_target`) and
replays its units for every later block of the same shape. It is reached
through one function only, :func:`~._dtype_units.plan_dtype_units`, and is
switched off with ``fsdptx.caches(enabled=False)`` (``replay_blocks``), so
the plain planner stays the reference it must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._types import Unit
from ._resolver import _plan_target, _Resolver


@dataclass(frozen=True)
class _UnitShape:
    """One unit a block's planning made, relative to the block: module
    positions from the block's walk position, parameter and ignored slots
    from its first slot, in the unit's (name-sorted) order."""

    unit: Unit
    modules: tuple[int, ...]
    params: tuple[int, ...]
    ignored: tuple[int, ...]


@dataclass
class _BlockReplay:
    """Plans a block built like one planned before by replaying its units.

    Real models repeat one block class many times, and planning one block
    depends only on what :meth:`shape` records: the subtree's classes, tree
    shape and names; each parameter slot's owner, name, (storage, compute)
    key, and whether it is frozen, ignored or already owned; which modules
    are sharded already. Two blocks with equal shapes get the same units up
    to the block's FQN prefix (a common prefix keeps name order), so the
    second one onward costs a comparison and the units' construction instead
    of surveys and descents. A block holding a tied parameter, a model with
    shared modules, and every error take the full planning.
    """

    r: _Resolver
    shapes: dict[tuple[object, ...], tuple[_UnitShape, ...] | None] = field(default_factory=dict)

    def shape(self, top: int) -> tuple[object, ...] | None:
        """What planning the block at walk position ``top`` depends on, or
        ``None`` when it cannot be replayed."""
        r, index = self.r, self.r.index
        if index.shared_modules:
            return None
        walk, end = index.walk, index.subtree_end[top]
        first, last = index.slot_start[top], index.slot_start[end]
        aliases, keys, frozen, excluded, ignored, owner = (
            index.aliases, r.keys, r.frozen, r.excluded, r.ignored, r.owner
        )
        slots = []
        for p in walk.params[first:last]:
            pid = id(p)
            if pid in aliases:
                return None
            taken = 2 if pid in owner else 1 if pid in excluded else 0
            slots.append((keys.get(pid), pid in frozen, taken, pid in ignored, pid in r.intrinsic))
        sharded = r.sharded
        return (
            tuple(walk.types[top:end]),
            tuple(up - top for up in walk.parents[top + 1 : end]),
            tuple(walk.names[top + 1 : end]),
            tuple(id(m) in sharded for m in walk.modules[top + 1 : end]),
            tuple(o - top for o in walk.owners[first:last]),
            tuple(walk.slot_names[first:last]),
            tuple(slots),
        )

    def record(self, shape: tuple[object, ...], top: int, units: list[Unit]) -> None:
        """Remember the units the full planning just made for the block at
        ``top``; a unit naming anything outside the block is not replayable."""
        index = self.r.index
        first, last = index.slot_start[top], index.slot_start[index.subtree_end[top]]
        slot_of = {f: i - first for i, f in enumerate(index.slot_fqn[first:last], first)}
        position = index.walk.position
        try:
            self.shapes[shape] = tuple(
                _UnitShape(
                    u,
                    tuple(position[id(index.modules[m])] - top for m in u.modules),
                    tuple(slot_of[f] for f in u.params),
                    tuple(slot_of[f] for f in u.ignored_params),
                )
                for u in units
            )
        except KeyError:
            self.shapes[shape] = None

    def replay(self, shapes: tuple[_UnitShape, ...], top: int) -> None:
        """Add the recorded units for the block at ``top``, with the effects
        :meth:`_Resolver.add` has: its parameters owned, its modules sharded."""
        r, index = self.r, self.r.index
        first = index.slot_start[top]
        fqns, modules, params, facts = index.module_fqns, index.walk.modules, index.walk.params, index.param_facts
        slot_fqn, excluded, owner, sharded = index.slot_fqn, r.excluded, r.owner, r.sharded
        for shape in shapes:
            position = len(r.units)
            numel = nbytes = 0
            for s in shape.params:
                pid = id(params[first + s])
                _dtype, n, b, _hint, _grad = facts[pid]
                numel += n
                nbytes += b
                excluded.add(pid)
                owner[pid] = position
            u = shape.unit
            r.units.append(
                Unit(
                    modules=tuple(fqns[top + m] for m in shape.modules),
                    params=tuple(slot_fqn[first + s] for s in shape.params),
                    ignored_params=tuple(slot_fqn[first + s] for s in shape.ignored),
                    kind=u.kind,
                    storage_dtype=u.storage_dtype,
                    compute_dtype=u.compute_dtype,
                    mp_policy=u.mp_policy,
                    offload_policy=u.offload_policy,
                    reshard_after_forward=u.reshard_after_forward,
                    numel=numel,
                    nbytes=nbytes,
                    mesh=u.mesh,
                    reasons=u.reasons,
                )
            )
            sharded.update(id(modules[top + m]) for m in shape.modules)

    def plan(self, fqn: str, reshard: bool | int | None) -> None:
        """:func:`_plan_target` for a block (never the root), replayed when a
        block of the same shape was planned before."""
        r = self.r
        target = r.index.module(fqn, "shard_by_dtype target")
        top = r.index.walk.position[id(target)]
        shape = None if id(target) in r.sharded else self.shape(top)
        recorded = self.shapes.get(shape) if shape is not None else None
        if recorded is not None:
            self.replay(recorded, top)
            return
        before = len(r.units)
        _plan_target(r, fqn, reshard, False)
        if shape is not None and shape not in self.shapes:
            self.record(shape, top, r.units[before:])
