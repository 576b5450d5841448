"""Block replay: the optional fast path of dtype planning.

Real models repeat one block class many times; :class:`_BlockReplay` plans
the first block of a shape in full (:func:`~._resolver._plan_target`) and
replays its units for every later block of the same shape. It is reached
through one function only, :func:`~._dtype_units.plan_dtype_units`, and is
switched off with ``fsdptx.caches(enabled=False)`` (``replay_blocks``), so
the plain planner stays the reference it must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


Parts = list[Sequence[Any] | None]  # slices of the index's columns, or None for 'nothing of the block'
Shape = tuple[tuple[Any, ...] | None, ...]  # the parts, hashable


@dataclass
class _BlockReplay:
    """Plans a block built like one planned before by replaying its units.

    Real models repeat one block class many times, and planning one block
    depends only on what :meth:`shape` records: the subtree's classes, tree
    shape and names; each parameter slot's module, name, dtype,
    ``requires_grad``, numel and (storage, compute) key, and whether it is
    ignored, already owned or fp32 by the bulk rule; which modules are
    sharded already. Two blocks with equal shapes get the same units up to
    the block's FQN prefix (a common prefix keeps name order), so the
    second one onward costs a comparison and the units' construction instead
    of surveys and descents. A block holding a tied parameter, a model with
    shared modules, and every error take the full planning.
    """

    r: _Resolver
    shapes: dict[Shape, tuple[_UnitShape, ...] | None] = field(default_factory=dict)
    last: tuple[Parts, tuple[_UnitShape, ...]] | None = None  # the previous block's parts and units

    def parts(self, top: int) -> Parts | None:
        """What planning the block at walk position ``top`` depends on, as
        slices of the index's columns (plus the resolver's state, asked
        about the block one by one only when it holds something of it), or
        ``None`` when the block cannot be replayed. No loop here runs per
        module or parameter in Python: this runs once per block, and such
        a loop would cost about what replaying saves."""
        r, index = self.r, self.r.index
        if index.shared_modules:
            return None
        walk, end = index.walk, index.subtree_end[top]
        first, last = index.subtree_slots(top)
        pids = walk.param_ids[first:last]
        if index.aliases and not index.aliases.keys().isdisjoint(pids):
            return None
        excluded, sharded = r.excluded, r.sharded
        ids = list(map(id, walk.modules[top + 1 : end])) if sharded else []
        return [
            walk.types[top:end],
            index.up_distance[top + 1 : end],
            walk.names[top + 1 : end],
            index.direct_counts[top:end],
            walk.slot_names[first:last],
            walk.facts[first:last],  # dtype, requires_grad, ndim
            index.slot_numels[first:last],
            list(map(r.keys.get, pids)),
            None if sharded.isdisjoint(ids) else list(map(sharded.__contains__, ids)),
            None if excluded.isdisjoint(pids) else [(p in r.owner, p in excluded, p in r.ignored) for p in pids],
            None if r.intrinsic.isdisjoint(pids) else list(map(r.intrinsic.__contains__, pids)),
        ]

    def record(self, shape: Shape, top: int, units: list[Unit]) -> None:
        """Remember the units the full planning just made for the block at
        ``top``; a unit naming anything outside the block is not replayable."""
        index = self.r.index
        first, last = index.subtree_slots(top)
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
        :meth:`_Resolver.add` has: its parameters owned, its modules sharded.
        The units' sizes are the recorded ones: the shape holds every slot's
        dtype and numel."""
        r, index = self.r, self.r.index
        end = index.subtree_end[top]
        first, last = index.subtree_slots(top)
        fqns, modules = index.module_fqns[top:end], index.walk.modules[top:end]
        slot_fqn, pids = index.slot_fqn[first:last], index.walk.param_ids[first:last]
        units, owner = r.units, r.owner
        for shape in shapes:
            owned = list(map(pids.__getitem__, shape.params))
            r.excluded.update(owned)
            owner.update(dict.fromkeys(owned, len(units)))
            units.append(
                _renamed(
                    shape.unit,
                    tuple(map(fqns.__getitem__, shape.modules)),
                    tuple(map(slot_fqn.__getitem__, shape.params)),
                    tuple(map(slot_fqn.__getitem__, shape.ignored)),
                )
            )
            r.sharded.update(map(id, map(modules.__getitem__, shape.modules)))

    def plan(self, fqn: str, reshard: bool | int | None) -> None:
        """:func:`_plan_target` for a block (never the root), replayed when a
        block of the same shape was planned before: the previous block's,
        compared part by part (the usual case: blocks come in a row), or
        any earlier one's, looked up by the shape's hash."""
        r = self.r
        target = r.index.module(fqn, "shard_by_dtype target")
        top = r.index.walk.position[id(target)]
        parts = None if id(target) in r.sharded else self.parts(top)
        if parts is not None and self.last is not None and parts == self.last[0]:
            self.replay(self.last[1], top)
            return
        shape: Shape | None = None if parts is None else tuple(p if p is None else tuple(p) for p in parts)
        recorded = self.shapes.get(shape) if shape is not None else None
        if recorded is None:
            before = len(r.units)
            _plan_target(r, fqn, reshard, False)
            if shape is not None and shape not in self.shapes:
                self.record(shape, top, r.units[before:])
            recorded = self.shapes.get(shape) if shape is not None else None
        else:
            self.replay(recorded, top)
        self.last = (parts, recorded) if parts is not None and recorded is not None else None


def _renamed(unit: Unit, modules: tuple[str, ...], params: tuple[str, ...], ignored: tuple[str, ...]) -> Unit:
    """``dataclasses.replace(unit, modules=..., params=..., ignored_params=...)``
    without its per-field introspection (a replayed model builds thousands
    of units): a copy of the frozen instance's fields with three changed.
    ``Unit`` has no ``__post_init__`` to run again."""
    copy = object.__new__(Unit)
    fields = copy.__dict__
    fields.update(unit.__dict__)
    fields["modules"], fields["params"], fields["ignored_params"] = modules, params, ignored
    return copy
