"""Dtype units: the units ``shard_by_dtype``'s request asks for.

:func:`plan_dtype_units` plans every target of a :class:`DtypeRequest`
(blocks, then the root), each a ModuleList's elements when the target is one,
skipping a block whose tied parameter is also used outside the blocks
(:func:`_tied_outside`), and replaying blocks built alike
(:mod:`._replay`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...model._index import ModelIndex, PlanningError
from .._types import DtypeRequest
from ._replay import _BlockReplay
from ._resolver import _Resolver
from ._target import _plan_target, _shardable


def plan_dtype_units(r: _Resolver, request: DtypeRequest, *, replay_blocks: bool = True) -> None:
    """Plan every dtype target of ``request``; blocks built alike are
    replayed (:class:`_BlockReplay`) unless ``replay_blocks`` is off. A
    single target (one call of the imperative API) has nothing to replay
    from, so it skips recording shapes."""
    index = r.index
    replay = _BlockReplay(r) if replay_blocks and len(request.targets) > 1 else None
    pending: list[str] = []  # blocks for replay to plan, in order, before the next plain target
    for fqn in request.targets:
        target = index.module(fqn, "shard_by_dtype target")
        if id(target) in index.sharded:
            raise PlanningError(
                f"shard_by_dtype: target {fqn or '<root>'!r} is already an FSDP module; plan the "
                "model before sharding it, or leave already-sharded modules out of blocks="
            )
        for element, _m in _shardable(fqn, target):  # a ModuleList target means its elements
            is_root = element == "" and request.always_shard_root
            if element and index.tied and _tied_outside(index, element, request.targets):
                continue  # the enclosing unit owns the tie: see _tied_outside
            if replay is not None and not is_root:
                pending.append(element)
                continue
            if replay is not None and pending:
                replay.plan_blocks(pending, request.reshard_after_forward)
                pending = []
            _plan_target(r, element, request.reshard_after_forward, is_root)
    if replay is not None and pending:
        replay.plan_blocks(pending, request.reshard_after_forward)


def _tied_outside(index: ModelIndex, fqn: str, targets: Sequence[str]) -> bool:
    """Whether module ``fqn`` holds a parameter also registered in a module
    that is in no target (not a block).

    Such a target gets no unit of its own: FSDP2 needs a tied parameter in
    one unit, and a unit of the target would own it while the module outside
    (BERT's ``cls.predictions.decoder``, tied to the embeddings that
    ``_no_split_modules`` lists) still uses it. The enclosing unit, the
    root's when nothing smaller holds both, owns the target's parameters.
    A tie between two blocks is left to the planner, which refuses it
    naming both names (no common unit short of the root would hold it)."""
    top = index.walk.position[id(index.modules[fqn])]
    blocks = tuple(t + "." for t in targets if t)
    first, end = index.subtree_slots(top)
    for p in index.walk.params[first:end]:
        if id(p) in index.aliases and any(not n.startswith(blocks) for n in index.names(p)):
            return True
    return False
