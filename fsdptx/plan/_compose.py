"""Composing and running transforms ``(model, Plan) -> Plan``.

The :class:`Transform` protocol, :func:`compose` (which fuses consecutive
sharding transforms and resolves their units once), :func:`plan` and
:func:`plan_indexed` (which run a transform on an empty Plan), the model
index a pipeline shares (:func:`model_index`), and :func:`_resolve`, which
turns the requests recorded in a Plan into units. No particular transform
lives here: those are in :mod:`fsdptx.plan.transforms`, which imports this
module, and ``compose`` tells them apart by the kind each declares
(:mod:`fsdptx.plan._kinds`), importing none of them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ..core._args import require_module
from ..core._policy import check_policy_dtypes
from ..model._index import ModelIndex, PlanningError
from ._kinds import reads_no_units as _reads_no_units, request_of as _request_of
from ._plan import Plan
from ._types import Unit, marks_under_exclusions
from ._vouch import vouch, vouch_marks
from .resolve import resolve_units

__all__ = ["Transform", "check_reshard", "check_transform_args", "compose", "model_index", "plan", "plan_indexed"]


class Transform(Protocol):
    """Reads a model and returns a new Plan; never mutates either.

    The sharding transforms resolve ``Plan.units`` from the requests recorded
    in the Plan, replacing whatever units it held: a transform of your own that
    edits units should run after them.

    Example::

        def no_reshard(model: nn.Module, plan: fsdptx.Plan, /) -> fsdptx.Plan:
            return plan.replace(units=tuple(dataclasses.replace(u, reshard_after_forward=False) for u in plan.units))

        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, no_reshard))
    """

    def __call__(self, model: nn.Module, plan: Plan, /) -> Plan: ...


def transform_name(t: object) -> str:
    """A readable name for a transform, seeing through ``functools.partial``."""
    if isinstance(t, functools.partial):
        return f"partial({transform_name(t.func)}, ...)"
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)


def _checked(t: Transform, model: nn.Module, p: Plan) -> Plan:
    result = t(model, p)
    if not isinstance(result, Plan):
        raise TypeError(
            f"transform {transform_name(t)} returned {type(result).__name__}, not a Plan; "
            "a transform must return the new Plan (e.g. plan.replace(...))"
        )
    return result


def compose(*transforms: Transform) -> Transform:
    """Chain transforms left to right into one transform.

    For ``shard_by_dtype``, ``shard_across_blocks`` and ``mark_reduction`` the
    result does not depend on argument order: cross-block units always own their
    holders and dtype units always exclude them, because units are resolved
    from the sharding requests recorded in the Plan, never patched.

    Consecutive sharding transforms (bare or ``functools.partial`` with
    keywords; ``mark_reduction`` between them does not interrupt the run) are
    fused: their requests are recorded and the units resolved once. The Plan
    is the one applying them one by one gives; only an intermediate state
    that cannot be planned on its own (say, blocks whose fp32 holders are
    isolable only once a cross-block unit owns them) is never resolved.

    Args:
        *transforms: transforms, applied left to right.

    Returns:
        One transform; a Plan that went through it never depends on the
        order of the sharding transforms among ``transforms``.

    Raises:
        TypeError: a transform is not callable (here), or one returns
            something other than a Plan (when the pipeline runs).

    Example::

        pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
        p = fsdptx.plan(model, pipeline)
    """

    for i, t in enumerate(transforms):
        if not callable(t):
            raise TypeError(
                f"compose: transforms[{i}] must be callable (model, Plan) -> Plan, got {type(t).__name__} {t!r}"
            )

    def composed(model: nn.Module, p: Plan, /) -> Plan:
        own_scratch = not isinstance(p.scratch, ModelIndex)
        if own_scratch:
            p = p.replace(scratch=ModelIndex.build(model))
        pending = False
        for t in transforms:
            request = _request_of(t)
            if request is not None:
                fn, options = request
                p = fn(model, p, **options)
                pending = True
                continue
            if pending and not _reads_no_units(t):
                p, pending = _resolve(model, p, model_index(model, p)), False
            p = _checked(t, model, p)
        if pending:
            p = _resolve(model, p, model_index(model, p))
        return p.replace(scratch=None) if own_scratch else p

    composed.__qualname__ = "compose(" + ", ".join(transform_name(t) for t in transforms) + ")"
    return composed


def plan(
    model: nn.Module,
    transform: Transform,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> Plan:
    """Run ``transform`` on an empty Plan carrying these defaults.

    ``mp_policy=None`` means mixed precision disabled. Pure: the model is only
    read, so this is safe on a meta-device skeleton or a live model alike.

    Args:
        model: the model to plan for; only read (a meta-device model works).
        transform: a transform, usually a :func:`compose` pipeline.
        mp_policy: the default policy units start from.
        offload_policy: the default offload policy of every unit.
        reshard_after_forward: the default reshard setting (``None``:
            FSDP2's default, refined by :func:`reshard_policy`).

    Returns:
        The Plan, with what planning vouched for, so ``apply_plan`` on the
        unchanged model skips re-deriving each unit's claims.

    Raises:
        TypeError: an argument has the wrong type, or the transform returns
            something other than a Plan.
        PlanningError: the request cannot be planned for this model (nothing
            about the model is changed).

    Example::

        p = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        print(p)
    """
    require_module(model, "model", "plan")
    return plan_indexed(
        model,
        transform,
        ModelIndex.build(model),
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
    )


def plan_indexed(
    model: nn.Module,
    transform: Transform,
    index: ModelIndex,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> Plan:
    """:func:`plan` reading ``index``, the model's index built a moment ago
    (the manager hands the same index on to ``apply_plan``'s checks, so
    ``parallelize`` walks its model once)."""
    require_module(model, "model", "plan")
    if not callable(transform):
        raise TypeError(f"plan: transform must be callable (model, Plan) -> Plan, got {type(transform).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"plan: mp_policy must be a MixedPrecisionPolicy or None, got {mp_policy!r}")
    check_policy_dtypes(mp_policy, "plan")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"plan: offload_policy must be an OffloadPolicy or None, got {offload_policy!r}")
    start = Plan(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=check_reshard(reshard_after_forward, "plan"),
        scratch=index,
    )
    planned = _checked(transform, model, start)
    problem = marks_under_exclusions(planned.reductions, planned.exclusions, planned.expert_modules)
    if problem is not None:
        raise PlanningError(f"plan: {problem}")
    return planned.replace(scratch=None, verified=vouch_marks(model_index(model, planned), planned))


def check_reshard(value: object, where: str) -> bool | int | None:
    """``reshard_after_forward`` must be None, a bool, or a world size >= 1;
    caught here so a typo fails at planning, not inside the primitive after
    earlier units were already sharded."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise PlanningError(
        f"{where}: reshard_after_forward must be None, True, False or a positive int world size, "
        f"got {value!r}"
    )


def check_transform_args(model: object, plan: object, where: str, plan_argument: str = "plan") -> None:
    """A transform called on its own gets what ``plan()`` would hand it: a
    module and a Plan (a wrong type would otherwise fail as an
    ``AttributeError`` deep inside, naming neither)."""
    require_module(model, "model", where)
    if not isinstance(plan, Plan):
        raise TypeError(f"{where}: {plan_argument} must be an fsdptx.Plan (start from fsdptx.Plan()), got {type(plan).__name__}")


def model_index(model: nn.Module, p: Plan) -> ModelIndex:
    """The index shared through ``plan()``, or a fresh one for a transform
    called on its own."""
    if isinstance(p.scratch, ModelIndex) and p.scratch.root is model:
        return p.scratch
    return ModelIndex.build(model)


def _resolve(model: nn.Module, p: Plan, index: ModelIndex) -> Plan:
    units = resolve_units(
        model,
        mp_policy=p.mp_policy,
        offload_policy=p.offload_policy,
        cross_blocks=p.cross_block_requests,
        dtype_request=p.dtype_request,
        index=index,
    )
    if p.expert_modules:
        units = tuple(_on_moe_mesh(u, p.expert_modules) for u in units)
    return p.replace(units=units, verified=vouch(index, units))


def _on_moe_mesh(unit: Unit, experts: tuple[str, ...]) -> Unit:
    """Units inside an expert module shard over the MoE mesh."""
    inside = [e for e in experts if all(m == e or m.startswith(e + ".") for m in unit.modules)]
    if not inside:
        return unit
    kind = "expert" if unit.modules == (inside[0],) else unit.kind
    return dataclasses.replace(unit, mesh="moe", kind=kind)
