"""Which modules ``apply_plan`` feeds fp32 inputs (the hook itself and why a
wholly fp32 module needs it: :mod:`fsdptx.apply._inputs`).

The answer depends only on the units and on which parameters sit below each
unit module, which a vouched plan's signature holds fixed, so planning
records it (:func:`fsdptx.plan._vouch.vouch_marks`) from the index it
already has, and applying that plan reads it back instead of walking every
fp32 module's parameters again."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..model._index import ModelIndex

__all__ = ["wholly_fp32_modules"]


def wholly_fp32_modules(
    units: Iterable[tuple[Sequence[str], Sequence[nn.Module], Sequence[str], torch.dtype | None]],
    index: ModelIndex | None = None,
) -> list[nn.Module]:
    """The modules of fp32 units (``(module FQNs, modules, parameter FQNs,
    compute dtype)``; only fp32 units' modules are read) whose every
    parameter, children's included, belongs to an fp32 unit. None where
    every unit computes in fp32: activations are fp32 throughout.

    ``index``, the model's index as it is now, gives each module's
    parameter names as a slice of its slots instead of a walk of the
    module; it is used only on a plain tree (no tied parameter, no shared
    module), where the two agree name for name."""
    units = list(units)
    if all(compute == torch.float32 for _fqns, _modules, _params, compute in units):
        return []
    in_fp32 = {name for _fqns, _modules, params, compute in units if compute == torch.float32 for name in params}
    names_below = _from_index(index) if index is not None and not index.tied and not index.shared_modules else None
    found: list[nn.Module] = []
    for fqns, modules, _params, compute in units:
        if compute != torch.float32:
            continue
        for fqn, module in zip(fqns, modules):
            names = names_below(module) if names_below is not None else None
            if names is None:
                names = [f"{fqn}.{n}" if fqn else n for n, _p in module.named_parameters()]
            if names and in_fp32.issuperset(names):
                found.append(module)
    return found


def _from_index(index: ModelIndex) -> Callable[[nn.Module], list[str] | None]:
    """The parameter FQNs of a module's subtree, read from ``index``'s
    slots (``None`` for a module the index did not walk)."""
    position, slot_fqn = index.walk.position, index.slot_fqn

    def names(module: nn.Module) -> list[str] | None:
        at = position.get(id(module))
        if at is None:
            return None
        first, end = index.subtree_slots(at)
        return slot_fqn[first:end]

    return names
