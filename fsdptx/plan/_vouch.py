"""Vouching: a Plan carries the signature of the model its units were
resolved against (:class:`Vouched`), so applying it costs one walk and a
comparison instead of re-deriving each unit's claims (the walk and its
signature: :mod:`fsdptx.model._walk`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, compress, islice, repeat
from typing import TYPE_CHECKING, get_args

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ..core._caches import caches_enabled
from ..core._policy import policy_dtype_problems
from ..model._unit_checks import refused_class
from ..model._walk import _DTYPE_GRAD, _NDIM, ModelWalk, Signature, walk_model
from ._fp32_inputs import wholly_fp32_modules
from ._types import Reduction, UnitKind

if TYPE_CHECKING:
    from ..model._index import ModelIndex
    from ._plan import Plan
    from ._types import Unit, Verification

__all__ = [
    "MarkTargets",
    "Vouched",
    "reductions_by_module",
    "settings_problems",
    "vouch",
    "vouch_marks",
    "vouched_modules",
]


def reductions_by_module(reductions: Mapping[str, Reduction]) -> dict[str, dict[str, Reduction]]:
    """A plan's marks (parameter FQN -> reduction) grouped by the FQN of the
    module holding each parameter, by the parameter's local name: what
    :func:`fsdptx.tp._marks.mark_parameter_reductions` takes, once per module."""
    by_module: dict[str, dict[str, Reduction]] = {}
    for fqn, reduction in reductions.items():
        module_fqn, _, name = fqn.rpartition(".")
        by_module.setdefault(module_fqn, {})[name] = reduction
    return by_module


def settings_problems(i: int, unit: Unit) -> list[str]:
    """What the primitive would refuse in the unit's own settings."""
    problems: list[str] = []
    if unit.mp_policy is not None and not isinstance(unit.mp_policy, MixedPrecisionPolicy):
        problems.append(f"unit {i}: mp_policy {unit.mp_policy!r} is not a MixedPrecisionPolicy or None")
    else:
        problems.extend(policy_dtype_problems(unit.mp_policy, f"unit {i}"))
    for name in ("storage_dtype", "compute_dtype"):
        value = getattr(unit, name)
        if value is not None and not isinstance(value, torch.dtype):
            problems.append(f"unit {i}: {name} {value!r} is not a torch dtype or None")
    if unit.kind not in get_args(UnitKind):
        problems.append(f"unit {i}: kind {unit.kind!r} is not one of {', '.join(get_args(UnitKind))}")
    if unit.offload_policy is not None and not isinstance(unit.offload_policy, OffloadPolicy):
        problems.append(f"unit {i}: offload_policy {unit.offload_policy!r} is not an OffloadPolicy or None")
    if unit.mesh not in ("dp", "moe"):
        problems.append(f"unit {i}: mesh {unit.mesh!r} is neither 'dp' nor 'moe'")
    r = unit.reshard_after_forward
    if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r >= 1)):
        problems.append(f"unit {i}: reshard_after_forward={r!r} is not None, a bool or a positive int")
    return problems


@dataclass(frozen=True, eq=False)
class Vouched:
    """What planning vouches for: ``units`` (this very tuple) were resolved
    against a model whose walk had this signature, and are found, in walk
    order, at ``positions``. ``reductions``/``exclusions`` (these very
    objects) were checked against the same model, or are ``None``; then
    ``marks`` holds, per module holding marked parameters, its walk
    position and its marks by local name, and ``excluded`` the walk
    position of each excluded module. ``fp32_inputs``: the walk positions
    of the modules whose inputs applying casts to fp32 (see
    :mod:`fsdptx.plan._fp32_inputs`), or ``None`` where planning did not
    record them."""

    signature: Signature
    units: tuple[Unit, ...]
    positions: tuple[tuple[int, ...], ...]
    reductions: Mapping[str, Reduction] | None = None
    exclusions: tuple[str, ...] | None = None
    marks: tuple[tuple[int, Mapping[str, Reduction]], ...] = ()
    excluded: tuple[int, ...] = ()
    fp32_inputs: tuple[int, ...] | None = None


# The modules a plan's marks go to: per module holding marked parameters,
# its marks by local name; and the excluded modules.
MarkTargets = tuple[list[tuple[nn.Module, Mapping[str, Reduction]]], list[nn.Module]]


def vouch(index: ModelIndex, units: tuple[Unit, ...]) -> Vouched | None:
    """Vouch for ``units``, just resolved from ``index``; ``None`` (no
    vouching: the full check runs and names the problems) while caches are
    off (:func:`fsdptx.caches`), when the index
    did not see the whole model, some parameter is a scalar or a trainable
    non-floating (complex) one (the planner does not group those by dtype),
    or the primitive would refuse some unit's settings or modules. Those
    depend only on the units and the modules' classes, which the signature
    holds fixed, so applying a vouched plan re-checks none of them."""
    walk = index.walk
    if not caches_enabled() or not walk.complete or 0 in map(_NDIM, walk.facts):
        return None
    if any(grad and not dtype.is_floating_point for dtype, grad in set(map(_DTYPE_GRAD, walk.facts))):
        return None  # a trainable complex parameter: the planner leaves it keyless
    positions = _positions(index, [u.modules for u in units])
    # What the primitive refuses depends on a module's class and a unit's
    # settings' kinds alone: ask once per refused position and per kind of
    # settings, not once per unit (a model has thousands of units).
    refused = {t for t in set(walk.types) if refused_class(t)}
    if refused and not set(compress(range(len(walk.types)), map(refused.__contains__, walk.types))).isdisjoint(
        chain.from_iterable(positions)
    ):
        return None
    settings = {
        (_hashable(u.mp_policy), type(u.offload_policy), u.mesh, _hashable(u.reshard_after_forward), u.kind)
        + (u.storage_dtype, u.compute_dtype): u
        for u in units
    }
    if any(settings_problems(0, u) for u in settings.values()):
        return None
    return Vouched(walk.signature, units, positions)


def _hashable(value: object) -> object:
    """``value`` as a dict key: itself, or its identity when unhashable."""
    try:
        hash(value)
    except TypeError:
        return ("unhashable", id(value))
    return value


def vouch_marks(index: ModelIndex, plan: Plan) -> Verification | None:
    """``plan.verified`` extended to what applying reads besides the units:
    the modules whose inputs it casts to fp32, found from ``index`` (the
    model the units were vouched for), and the plan's reductions and
    exclusions when each names a parameter or module of that model."""
    vouched = plan.verified
    if not isinstance(vouched, Vouched) or vouched.units is not plan.units:
        return vouched
    if index.walk.signature is not vouched.signature and not vouched.signature.matches(index.walk):
        return vouched  # positions read from this index would not be the vouched walk's
    modules, position = index.modules, index.walk.position
    fp32 = wholly_fp32_modules(
        (
            (u.modules, [modules[f] for f in u.modules] if u.compute_dtype == torch.float32 else (), u.params, u.compute_dtype)
            for u in plan.units
        ),
        index,
    )
    vouched = dataclasses.replace(vouched, fp32_inputs=tuple(position[id(m)] for m in fp32))
    # Every slot holds its parameter's canonical name: a set of them is
    # the parameters' names, without building a table of the parameters.
    named = set(index.slot_fqn).issuperset(plan.reductions) and all(f in index.modules for f in plan.exclusions)
    if not named:
        return vouched
    by_module = reductions_by_module(plan.reductions)
    (marked, excluded) = _positions(index, [tuple(by_module), plan.exclusions])
    return dataclasses.replace(
        vouched,
        reductions=plan.reductions,
        exclusions=plan.exclusions,
        marks=tuple(zip(marked, by_module.values())),
        excluded=excluded,
    )


def _positions(index: ModelIndex, groups: list[tuple[str, ...]]) -> tuple[tuple[int, ...], ...]:
    """The walk positions of each group of module FQNs, looked up in one
    C-level pass over all of them and cut back into groups: a plan has
    thousands of units, most of one module each."""
    flat = chain.from_iterable(groups)
    found = iter(list(map(index.walk.position.__getitem__, map(id, map(index.modules.__getitem__, flat)))))
    return tuple(map(tuple, map(islice, repeat(found), map(len, groups))))


def vouched_modules(
    plan: Plan, model: nn.Module, walk: ModelWalk | None = None
) -> tuple[list[list[nn.Module]], MarkTargets, list[nn.Module] | None] | None:
    """Each unit's modules, the modules the marks go to, and the modules
    whose inputs are cast to fp32 (``None`` where planning did not record
    them), when the plan is vouched for and ``model`` walks to the same
    signature; ``None`` when anything calls for the full check (always,
    while caches are off). ``walk``: the model's walk as it is now, when
    the caller has one."""
    vouched = plan.verified
    if not caches_enabled() or not isinstance(vouched, Vouched) or vouched.units is not plan.units:
        return None
    if plan.reductions and vouched.reductions is not plan.reductions:
        return None
    if plan.exclusions and vouched.exclusions is not plan.exclusions:
        return None
    if walk is None:
        walk = walk_model(model)
        same = vouched.signature.matches(walk)
    else:  # the caller's walk: perhaps the very one planning vouched from
        same = walk.signature is vouched.signature or vouched.signature.matches(walk)
    if not same:
        return None
    found = walk.modules
    units = [[found[i] for i in at] for at in vouched.positions]
    fp32 = None if vouched.fp32_inputs is None else [found[i] for i in vouched.fp32_inputs]
    return units, ([(found[i], m) for i, m in vouched.marks], [found[i] for i in vouched.excluded]), fp32
