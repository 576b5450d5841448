"""What ``fully_shard`` would claim and reach from a module, read from the
model's index: :func:`claim`, and the survey (:func:`_survey`) the target
planner builds on.

A file of its own because it is the one piece of the planner other layers
need (``apply``'s checks call :func:`claim`), and it needs no resolver
state: only the index and the modules already sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ...model._index import ModelIndex

__all__ = ["claim"]

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
