"""The one effectful step: check a Plan against a model, then shard it.

Every check runs before the first call of the sharding primitive, so bad input
never leaves a model half-sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from ._marks import exclude_from_tp_replica_sync, mark_parameter_reduction
from ._plan import Plan, Unit
from ._planner import ModelIndex, claim, is_container
from ._policy import primitive_policy

__all__ = ["PlanMismatchError", "apply_plan", "check_plan", "shard_kwargs"]

ShardModule = Callable[..., Any]


class PlanMismatchError(ValueError):
    """The Plan does not fit the model it is applied to; nothing was changed."""


def _fail(problems: list[str]) -> None:
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise PlanMismatchError(
            "apply_plan: the plan does not fit this model; nothing was sharded:\n  - "
            + "\n  - ".join(shown)
            + "\nRe-plan with fsdptx.plan(model, ...) on the model as it is now."
        )


def check_plan(plan: Plan, model: nn.Module) -> list[list[nn.Module]]:
    """Validate ``plan`` against ``model`` and return each unit's modules.

    Checks, all before any mutation: every module and parameter FQN exists; no
    unit module is already an FSDP module or a bare container; no parameter
    is owned by two units; each unit would claim exactly the parameters the
    plan says (the plan is not stale); trainable parameters of a unit share one
    storage dtype (FSDP2's assertion, caught early); no scalar parameters;
    ``reshard_after_forward`` values are ones the primitive accepts.
    """
    index = ModelIndex.build(model)
    problems: list[str] = []
    resolved: list[list[nn.Module]] = []
    owner: dict[str, int] = {}
    for i, unit in enumerate(plan.units):
        mods = []
        for fqn in unit.modules:
            m = index.modules.get(fqn)
            if m is None:
                problems.append(f"unit {i}: module {fqn!r} does not exist in {type(model).__name__}")
            elif id(m) in index.sharded:
                problems.append(f"unit {i}: module {fqn!r} is already sharded (an FSDP module)")
            elif is_container(m):
                problems.append(
                    f"unit {i}: module {fqn!r} is a {type(m).__name__} without forward, which "
                    "fully_shard rejects; plan its elements instead"
                )
            else:
                mods.append(m)
        for pfqn in unit.params:
            if pfqn in owner:
                problems.append(f"parameter {pfqn!r} is claimed by units {owner[pfqn]} and {i}")
            owner[pfqn] = i
        resolved.append(mods)
    _fail(problems)

    sharded = set(index.sharded)
    for i, (unit, mods) in enumerate(zip(plan.units, resolved)):
        problems.extend(_check_unit(i, unit, mods, index, sharded))
        sharded.update(id(m) for m in mods)
    for pfqn in plan.reductions:
        if pfqn not in index.params:
            problems.append(f"reduction mark names parameter {pfqn!r}, which the model lacks")
    for mfqn in plan.exclusions:
        if mfqn not in index.modules:
            problems.append(f"exclusion names module {mfqn!r}, which the model lacks")
    _fail(problems)
    return resolved


def _check_unit(
    i: int, unit: Unit, mods: list[nn.Module], index: ModelIndex, sharded: set[int]
) -> list[str]:
    problems: list[str] = []
    r = unit.reshard_after_forward
    if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r >= 1)):
        problems.append(f"unit {i}: reshard_after_forward={r!r} is not None, a bool or a positive int")
    missing = [f for f in unit.ignored_params if f not in index.params]
    if missing:
        problems.append(f"unit {i}: ignored parameters {missing} do not exist")
    ignored = set(unit.ignored_params)
    claimed = [(f, p) for f, p in claim(index, mods, sharded) if f not in ignored]
    got = {f for f, _ in claimed}
    want = set(unit.params)
    if got != want:
        extra, lacking = sorted(got - want), sorted(want - got)
        detail = []
        if extra:
            detail.append(f"would also claim {extra}")
        if lacking:
            detail.append(f"would not reach {lacking}")
        problems.append(f"unit {i} ({', '.join(unit.modules) or '<root>'}): " + "; ".join(detail))
    trainable = {f: p.dtype for f, p in claimed if p.requires_grad}
    if len(set(trainable.values())) > 1:
        listed = ", ".join(f"{f}: {str(d).removeprefix('torch.')}" for f, d in trainable.items())
        problems.append(
            f"unit {i} ({', '.join(unit.modules) or '<root>'}) mixes storage dtypes ({listed}); "
            "FSDP2 needs one storage dtype per unit"
        )
    scalars = [f for f, p in claimed if p.dim() == 0]
    if scalars:
        problems.append(f"unit {i}: scalar parameters {scalars} cannot be sharded; make them 1-D")
    return problems


def _check_against_mesh(plan: Plan, mesh: DeviceMesh) -> list[str]:
    """An int ``reshard_after_forward`` is a world size to reshard to: it must
    divide the mesh's shard dimension, which only the mesh can tell."""
    sized = [(i, u) for i, u in enumerate(plan.units) if type(u.reshard_after_forward) is int]
    if not sized:
        return []
    shard_size = mesh.shape[-1]
    return [
        f"unit {i} ({', '.join(u.modules) or '<root>'}): reshard_after_forward={u.reshard_after_forward} "
        f"does not divide the shard dimension of the mesh ({shard_size})"
        for i, u in sized
        if shard_size % u.reshard_after_forward  # type: ignore[operator]
    ]


def shard_kwargs(unit: Unit, mesh: DeviceMesh) -> dict[str, Any]:
    """Keyword arguments for the primitive. ``reshard_after_forward=None`` and a
    ``None`` offload policy are left out so the primitive's defaults apply; a
    ``None`` mixed-precision policy becomes ``MixedPrecisionPolicy()``."""
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": primitive_policy(unit.mp_policy)}
    if unit.offload_policy is not None:
        kwargs["offload_policy"] = unit.offload_policy
    if unit.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = unit.reshard_after_forward
    return kwargs


def _live_param(root: nn.Module, fqn: str) -> nn.Parameter:
    """Look a parameter up now: sharding an earlier unit may have replaced it."""
    module_fqn, _, name = fqn.rpartition(".")
    module = root.get_submodule(module_fqn)
    p = module._parameters[name]
    assert p is not None
    return p


def apply_plan(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    shard_module: ShardModule = fully_shard,
) -> nn.Module:
    """Shard ``model`` as ``plan`` says: one ``shard_module`` call per unit, in
    order (a list of modules for a multi-module unit), then the TP-replica
    reduction marks and exclusions. Returns ``model``.

    The whole plan is checked first (:func:`check_plan`); on any problem a
    :class:`PlanMismatchError` lists them all and the model is untouched.
    ``shard_module`` is the primitive (``fully_shard`` by default) so tests can
    record calls and frameworks can substitute their own.
    """
    resolved = check_plan(plan, model)
    _fail(_check_against_mesh(plan, mesh))
    for unit, mods in zip(plan.units, resolved):
        kwargs = shard_kwargs(unit, mesh)
        if unit.ignored_params:
            kwargs["ignored_params"] = {_live_param(model, f) for f in unit.ignored_params}
        shard_module(mods[0] if len(mods) == 1 else mods, **kwargs)
    for pfqn, reduction in plan.reductions.items():
        module_fqn, _, name = pfqn.rpartition(".")
        mark_parameter_reduction(model.get_submodule(module_fqn), name, reduction)
    for mfqn in plan.exclusions:
        exclude_from_tp_replica_sync(model.get_submodule(mfqn))
    return model
