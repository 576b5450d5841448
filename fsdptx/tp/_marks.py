"""TP-replica marks: which reduction a replicated gradient gets, and which
subtrees stay rank-local.

Marks live on modules, not on parameter objects: ``fully_shard`` replaces a
module's parameters with new DTensor parameters, but keeps the module (and its
``__dict__``), so a mark set before sharding is still there after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import nn

from ..core._args import require_module
from ..plan._types import REDUCTIONS, Reduction

__all__ = [
    "exclude_from_tp_replica_sync",
    "is_excluded_from_tp_replica_sync",
    "mark_tp_replica_gradient_reduction",
    "tp_replica_reduction",
]

_REDUCTION_ATTR = "_fsdptx_tp_replica_reductions"
_EXCLUDE_ATTR = "_fsdptx_tp_replica_sync_excluded"
_NO_MARKS: Mapping[str, Reduction] = MappingProxyType({})

# Bumped by every function here that sets a mark or an exclusion. The TP
# sync caches what it derived from the marks (order, groups, buffer layout)
# and compares this one integer per call instead of re-reading every
# module's marks.
_generation = 0


def marks_generation() -> int:
    """A number that changes whenever any mark or exclusion is set (anywhere)."""
    return _generation


def _set(module: nn.Module, attr: str, value: object) -> None:
    global _generation
    # The instance __dict__, where the readers look: nn.Module.__setattr__
    # would first search the module's parameter, buffer and child tables.
    module.__dict__[attr] = value
    _generation += 1


def check_reduction(reduction: object, where: str) -> Reduction:
    if not isinstance(reduction, str):
        raise TypeError(f"{where}: reduction must be one of {REDUCTIONS}, got {type(reduction).__name__} {reduction!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: reduction {reduction!r} is not a TP-replica reduction; use one of {REDUCTIONS}")
    return reduction


def mark_tp_replica_gradient_reduction(module: nn.Module, reduction: Reduction) -> None:
    """Mark ``module``'s direct parameters with their TP-replica reduction.

    ``"mean"``: every TP rank computed the full gradient redundantly, so the
    replicas are averaged. ``"sum"``: each TP rank contributed a disjoint part
    (e.g. a router that sees only its sequence shard), so the parts are added.
    Unmarked replicated parameters use ``"mean"``.

    Args:
        module: the module whose direct parameters are marked.
        reduction: ``"mean"`` or ``"sum"``.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``reduction``
            not a str.
        ValueError: ``reduction`` is neither ``"mean"`` nor ``"sum"``.

    Example::

        for block in model.layers:
            fsdptx.mark_tp_replica_gradient_reduction(block.router, "sum")
    """
    require_module(module, "module", "mark_tp_replica_gradient_reduction")
    check_reduction(reduction, "mark_tp_replica_gradient_reduction")
    mark_parameter_reductions(
        module, {name: reduction for name, p in module._parameters.items() if p is not None}
    )


def mark_parameter_reductions(module: nn.Module, reductions: Mapping[str, Reduction]) -> None:
    """Mark direct parameters (by local name) of one module; what ``apply_plan`` uses."""
    marks: dict[str, Reduction] = dict(module_reductions(module))
    marks.update(reductions)
    _set(module, _REDUCTION_ATTR, marks)


def tp_replica_reduction(module: nn.Module, name: str) -> Reduction:
    """The reduction of ``module``'s direct parameter ``name`` (``"mean"`` unless marked)."""
    return module_reductions(module).get(name, "mean")


def module_reductions(module: nn.Module) -> Mapping[str, Reduction]:
    """All marks of ``module``'s direct parameters, by local name (unmarked: absent)."""
    # The instance __dict__ directly: nn.Module.__getattr__ makes a missing
    # attribute an exception, which costs more than the whole lookup.
    marks: Mapping[str, Reduction] = module.__dict__.get(_REDUCTION_ATTR, _NO_MARKS)
    return marks


def exclude_from_tp_replica_sync(module: nn.Module) -> None:
    """Keep ``module``'s whole subtree rank-local.

    For owners that shard over a mesh folding the TP ranks into another axis
    (expert parallelism): their local tensors are different shards, not
    replicas, even though nothing in their type says so. Neither their
    parameters nor their buffers are broadcast or reduced.

    Args:
        module: the root of the subtree kept rank-local.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example::

        for block in model.layers:
            fsdptx.exclude_from_tp_replica_sync(block.mlp.experts)
    """
    require_module(module, "module", "exclude_from_tp_replica_sync")
    _set(module, _EXCLUDE_ATTR, True)


def is_excluded_from_tp_replica_sync(module: nn.Module) -> bool:
    """Whether ``module`` itself carries the exclusion mark (ancestors not consulted)."""
    return bool(module.__dict__.get(_EXCLUDE_ATTR, False))
