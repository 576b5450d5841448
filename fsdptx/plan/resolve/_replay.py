"""Block replay: the optional fast path of dtype planning.

Real models repeat one block class many times; :class:`_BlockReplay` plans
the first block of a shape in full (:func:`~._target._plan_target`) and
replays its units for every later block of the same shape. It is reached
through one function only, :func:`~._dtype_units.plan_dtype_units`, and is
switched off with ``fsdptx.caches(enabled=False)`` (``replay_blocks``), so
the plain planner stays the reference it must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any

from ...model._index import ModelIndex
from .._types import Unit
from ._resolver import _Resolver
from ._target import _plan_target


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
_MODULE_PARTS = 5  # the first parts run per module, the rest per parameter slot
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
    of surveys and descents; a run of such blocks laid out one after another
    costs one comparison of shifted columns and the units' construction
    (:meth:`plan_blocks`). A block holding a tied parameter, a model with
    shared modules, and every error take the full planning.
    """

    r: _Resolver
    shapes: dict[Shape, tuple[_UnitShape, ...] | None] = field(default_factory=dict)
    last: tuple[Parts, tuple[_UnitShape, ...]] | None = None  # the previous block's parts and units

    def parts(self, top: int, n: int = 1) -> Parts | None:
        """What planning the ``n`` blocks laid out from walk position
        ``top`` depends on, as slices of the index's columns over all of
        them: the first :data:`_MODULE_PARTS` per module, the rest per
        parameter slot; the resolver's state is asked about the blocks only
        when it holds something of them (``None``: nothing). ``None`` when
        the blocks cannot be replayed. No loop here runs per module or
        parameter in Python: such a loop would cost about what replaying
        saves. A block's own name and place differ by design, so each
        block's first entry of those two columns is blanked."""
        r, index = self.r, self.r.index
        if index.shared_modules:
            return None
        walk = index.walk
        step = index.subtree_end[top] - top
        first, last = index.subtree_slots(top)
        stop, slot_stop = top + n * step, first + n * (last - first)
        pids = walk.param_ids[first:slot_stop]
        if index.aliases and not index.aliases.keys().isdisjoint(pids):
            return None
        ids = list(map(id, walk.modules[top:stop])) if r.sharded else []
        return [
            walk.types[top:stop],
            index.direct_counts[top:stop],
            _blanked(walk.names[top:stop], step),
            _blanked(index.up_distance[top:stop], step),
            None if r.sharded.isdisjoint(ids) else list(map(r.sharded.__contains__, ids)),
            walk.slot_names[first:slot_stop],
            walk.facts[first:slot_stop],  # dtype, requires_grad, ndim
            index.slot_numels[first:slot_stop],
            list(map(r.keys.get, pids)),
            *(
                None if state.isdisjoint(pids) else list(map(state.__contains__, pids))
                for state in (r.excluded, r.owner.keys(), r.ignored, r.intrinsic)
            ),
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

    def replay(self, shapes: tuple[_UnitShape, ...], tops: range) -> None:
        """Add the recorded units for the blocks at walk positions ``tops``
        (a step of one block's module count: blocks laid out one after
        another, each holding as many slots as the first), block by block,
        with the effects :meth:`_Resolver.add` has: their parameters owned,
        their modules sharded. The units' sizes are the recorded ones: the
        shape holds every slot's dtype and numel.

        Each name a unit takes sits at a fixed offset from its block's first
        module or slot, so one strided slice of a column names it for every
        block at once: the work per block is the units' construction."""
        r, index = self.r, self.r.index
        n, step, top = len(tops), tops.step, tops.start
        first, last = index.subtree_slots(top)
        width = last - first  # slots per block
        stop, slot_stop = top + n * step, first + n * width
        fqns, modules, slot_fqn, pids = index.module_fqns, index.walk.modules, index.slot_fqn, index.walk.param_ids
        base, per_block = len(r.units), len(shapes)
        made: list[list[Unit]] = []
        for j, shape in enumerate(shapes):
            names = _by_block([fqns[top + o : stop + o : step] for o in shape.modules], n)
            params = _by_block([slot_fqn[first + q : slot_stop + q : width] for q in shape.params], n)
            ignored = _by_block([slot_fqn[first + q : slot_stop + q : width] for q in shape.ignored], n)
            for q in shape.params:
                owned = pids[first + q : slot_stop + q : width]
                r.excluded.update(owned)
                r.owner.update(zip(owned, range(base + j, base + j + n * per_block, per_block)))
            for o in shape.modules:
                r.sharded.update(map(id, modules[top + o : stop + o : step]))
            made.append([_renamed(shape.unit, m, p, i) for m, p, i in zip(names, params, ignored)])
        r.units.extend(chain.from_iterable(zip(*made)))

    def repeats(self, top: int, n: int) -> bool:
        """Whether the ``n`` blocks laid out from walk position ``top`` are
        each built like the one before, in every one of their
        :meth:`parts`: each part compared with itself shifted by one block
        decides it for the whole run, at C level."""
        parts = self.parts(top, n)
        if parts is None:
            return False
        index = self.r.index
        first, last = index.subtree_slots(top)
        step, width = index.subtree_end[top] - top, last - first
        return all(
            part is None or part[:-shift] == part[shift:]
            for part, shift in zip(parts, chain(repeat(step, _MODULE_PARTS), repeat(width)))
            if shift
        )

    def run_length(self, tops: Sequence[int], i: int) -> int:
        """How many blocks from ``tops[i]`` on lie one after another in the
        walk, each with as many modules and slots as the first."""
        index = self.r.index
        end, start = index.subtree_end, index.slot_start
        top = tops[i]
        step, width = end[top] - top, start[end[top]] - start[top]
        n = 1
        while i + n < len(tops):
            at = top + n * step
            if tops[i + n] != at or end[at] != at + step or start[at + step] - start[at] != width:
                break
            n += 1
        return n

    def plan_blocks(self, fqns: Sequence[str], reshard: bool | int | None) -> None:
        """:meth:`plan` for each of ``fqns`` in order. A run of blocks laid
        out one after another and built alike (:meth:`repeats`) plans its
        first block, then replays that block's units onto the rest at once;
        any other block takes :meth:`plan` on its own.

        Planning a block whose units were recorded changes the resolver's
        state only inside that block, so what :meth:`repeats` read before
        the first block was planned still holds for the others."""
        index = self.r.index
        position = index.walk.position
        tops = [position[id(index.module(f, "shard_by_dtype target"))] for f in fqns]
        i = 0
        while i < len(fqns):
            n = self.run_length(tops, i)
            top = tops[i]
            step = index.subtree_end[top] - top
            alike = n > 1 and self.repeats(top, n)
            self.plan(fqns[i], reshard)
            if alike and self.last is not None:
                self.replay(self.last[1], range(top + step, top + n * step, step))
            else:
                for f in fqns[i + 1 : i + n]:
                    self.plan(f, reshard)
            i += n

    def plan(self, fqn: str, reshard: bool | int | None) -> None:
        """:func:`_plan_target` for a block (never the root), replayed when a
        block of the same shape was planned before: the previous block's,
        compared part by part (the usual case: blocks come in a row), or
        any earlier one's, looked up by the shape's hash."""
        r, index = self.r, self.r.index
        target = index.module(fqn, "shard_by_dtype target")
        top = index.walk.position[id(target)]
        parts = None if id(target) in r.sharded else self.parts(top)
        if parts is not None and self.last is not None and parts == self.last[0]:
            self.replay(self.last[1], _one_block(index, top))
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
            self.replay(recorded, _one_block(index, top))
        self.last = (parts, recorded) if parts is not None and recorded is not None else None


def _one_block(index: ModelIndex, top: int) -> range:
    """The block at walk position ``top`` alone, as :meth:`_BlockReplay.replay` takes it."""
    step = index.subtree_end[top] - top
    return range(top, top + step, step)


def _by_block(columns: list[list[str]], n: int) -> list[tuple[str, ...]]:
    """Per block, the names at each offset: the strided ``columns`` read
    across (``n`` empty tuples when there are none)."""
    return list(zip(*columns)) if columns else [()] * n


def _blanked(column: list[Any], step: int) -> list[Any]:
    """``column`` with every block's first entry replaced by ``None``."""
    column[::step] = [None] * len(range(0, len(column), step))
    return column


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
