"""Everything ``apply_plan`` checks before it changes anything: the units
against the model (the vouched fast path or the full re-derivation), the
plan against the meshes, the checkpointed and prefetched modules. One
:class:`PlanMismatchError` lists every problem; nothing is mutated first."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..core._args import require_module
from ..core._names import join_names
from ..core._meshes import moe_dp_dims, parallel_dims
from ..model._index import ModelIndex, kv_cache_switches
from ..model._unit_checks import module_problems
from ..plan.resolve import claim
from ..plan._plan import Plan
from ..plan._types import Checkpointing, Unit, marks_under_exclusions, preview
from ..plan._vouch import MarkTargets, settings_problems, vouched_modules
from ._experts import HandEpMesh, expert_parallel_problems, hand_ep_mesh
from ..tp._transform import check_tensor_parallel
from ._checkpoint import is_checkpointed

__all__ = [
    "PlanMismatchError",
    "check_against_mesh",
    "check_checkpointing",
    "check_kv_cache",
    "check_plan",
    "check_prefetch",
    "check_resolved",
    "checked_units",
    "fail",
    "require_mesh",
]


class PlanMismatchError(ValueError):
    """The Plan does not fit the model it is applied to; nothing was changed.

    A ``ValueError`` listing every problem found (up to twenty), each naming
    the unit, module or parameter concerned.

    Example::

        try:
            fsdptx.apply_plan(p, model, mesh)
        except fsdptx.PlanMismatchError as e:
            print(e)  # the model is exactly as it was
    """


def fail(problems: list[str]) -> None:
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise PlanMismatchError(
            "apply_plan: the plan does not fit this model; nothing was sharded:\n  - "
            + "\n  - ".join(shown)
            + "\nRe-plan with fsdptx.plan(model, ...) on the model as it is now."
        )


def require_mesh(mesh: object, shard_module: object, where: str) -> None:
    """With torch's own ``fully_shard`` the mesh must be a torch
    ``DeviceMesh`` (a string fails inside torch with an ``AttributeError``,
    possibly after earlier units were sharded). A substituted primitive may
    take its framework's own mesh object, handed to it as is."""
    if shard_module is fully_shard and not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"{where}: mesh must be a torch DeviceMesh (init_device_mesh(...)), got {type(mesh).__name__} {mesh!r}"
        )


def check_plan(plan: Plan, model: nn.Module) -> list[list[nn.Module]]:
    """Validate ``plan`` against ``model`` and return each unit's modules.

    Checks, all before any mutation: every module and parameter FQN exists; no
    unit module is already an FSDP module or a bare container; no parameter
    is owned by two units; each unit would claim exactly the parameters the
    plan says (the plan is not stale); trainable parameters of a unit share one
    storage dtype (FSDP2's assertion, caught early); no scalar parameters;
    ``reshard_after_forward`` values are ones the primitive accepts.

    A plan whose units the planner resolved and checked against this model,
    unchanged since (same walk signature: see
    :mod:`fsdptx.model._walk` and :mod:`fsdptx.plan._vouch`), is not checked again.

    Args:
        plan: the Plan to check.
        model: the model it would be applied to.

    Returns:
        Each unit's modules, in plan order.

    Raises:
        TypeError: ``plan`` is not a Plan or ``model`` not a module.
        PlanMismatchError: the plan does not fit the model.

    Example::

        units = fsdptx.check_plan(fsdptx.plan_from_json(text), model)  # before a long job starts
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"check_plan: plan must be an fsdptx.Plan, got {type(plan).__name__}")
    require_module(model, "model", "check_plan")
    return checked_units(plan, model)[0]


def checked_units(
    plan: Plan, model: nn.Module, index: ModelIndex | None = None
) -> tuple[list[list[nn.Module]], MarkTargets | None, list[nn.Module] | None]:
    """:func:`check_plan`'s modules, and, when a vouched plan's walk found
    them, the modules the marks go to and those whose inputs are cast to
    fp32 (each ``None`` otherwise: looked up by FQN, found from the model).
    ``index``: the model's index as it is now, read instead of walking the
    model again."""
    vouched = vouched_modules(plan, model, None if index is None else index.walk)
    if vouched is not None:
        return vouched
    return _check_in_full(plan, model, index if index is not None else ModelIndex.build(model)), None, None


def check_resolved(plan: Plan, resolved: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """The checks left for units just resolved from the model as it is
    (their claims hold): what the primitive would refuse in each unit's
    settings and modules. Returns ``resolved``."""
    problems: list[str] = []
    for i, (unit, mods) in enumerate(zip(plan.units, resolved)):
        problems.extend(settings_problems(i, unit))
        problems.extend(module_problems(i, unit.modules, mods))
    fail(problems)
    return resolved


def _check_in_full(plan: Plan, model: nn.Module, index: ModelIndex) -> list[list[nn.Module]]:
    """Re-derive every unit's claims on ``model`` as it is now (``index``)."""
    problems: list[str] = []
    resolved: list[list[nn.Module]] = []
    owner: dict[str, int] = {}
    for i, unit in enumerate(plan.units):
        present = tuple(f for f in unit.modules if f in index.modules)
        problems.extend(
            f"unit {i}: module {fqn!r} does not exist in {type(model).__name__}"
            for fqn in unit.modules
            if fqn not in index.modules
        )
        mods = [index.modules[f] for f in present]
        problems.extend(module_problems(i, present, mods))
        for pfqn in unit.params:
            if pfqn in owner:
                problems.append(f"parameter {pfqn!r} is claimed by units {owner[pfqn]} and {i}")
            owner[pfqn] = i
        resolved.append(mods)
    fail(problems)  # past here every unit module exists and passed module_problems

    sharded = set(index.sharded)
    for i, (unit, mods) in enumerate(zip(plan.units, resolved)):
        problems.extend(settings_problems(i, unit))
        problems.extend(_claim_problems(i, unit, mods, index, sharded))
        sharded.update(id(m) for m in mods)
    params = index.params  # once: with caches off, each read of the table computes it again
    for pfqn in plan.reductions:
        if pfqn not in params:
            problems.append(f"reduction mark names parameter {pfqn!r}, which the model lacks")
    for mfqn in plan.exclusions:
        if mfqn not in index.modules:
            problems.append(f"exclusion names module {mfqn!r}, which the model lacks")
    unapplied = marks_under_exclusions(plan.reductions, plan.exclusions, plan.expert_modules)
    if unapplied is not None:
        problems.append(unapplied)
    fail(problems)
    return resolved


def _claim_problems(
    i: int, unit: Unit, mods: list[nn.Module], index: ModelIndex, sharded: set[int]
) -> list[str]:
    """Whether the unit claims what the plan says, in one storage dtype."""
    problems: list[str] = []
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
        problems.append(f"unit {i} ({join_names(unit.modules)}): " + "; ".join(detail))
    trainable = {f: p.dtype for f, p in claimed if p.requires_grad}
    now = set(trainable.values())
    if unit.storage_dtype is not None and len(now) == 1 and now != {unit.storage_dtype}:
        problems.append(
            f"unit {i} ({join_names(unit.modules)}) was planned for {str(unit.storage_dtype).removeprefix('torch.')} "
            f"storage, but its parameters are {str(now.pop()).removeprefix('torch.')} now (the model was cast after planning)"
        )
    elif len(now) > 1:
        listed = ", ".join(f"{f}: {str(d).removeprefix('torch.')}" for f, d in trainable.items())
        problems.append(
            f"unit {i} ({join_names(unit.modules)}) mixes storage dtypes ({listed}); "
            "FSDP2 needs one storage dtype per unit"
        )
    scalars = [f for f, p in claimed if p.dim() == 0]
    if scalars:
        problems.append(f"unit {i}: scalar parameters {scalars} cannot be sharded; make them 1-D")
    return problems


def check_against_mesh(
    plan: Plan,
    model: nn.Module,
    mesh: object,
    moe_mesh: DeviceMesh | None,
    index: ModelIndex | None,
    hand: HandEpMesh = hand_ep_mesh,
) -> list[str]:
    """What only the meshes can tell: the dims are known, a TP plan has a
    ``tp`` dim to run on and fits its size, expert units have a MoE mesh,
    expert parallelism fits the MoE mesh's ``ep`` dim (see
    :func:`~fsdptx.apply._experts.expert_parallel_problems`), and an int
    ``reshard_after_forward`` divides the shard dim."""
    problems: list[str] = _offload_problems(plan)
    if not isinstance(mesh, DeviceMesh):
        # Another framework's mesh object, handed to its own primitive as is.
        return problems + (["the plan has tensor parallelism, which needs a torch DeviceMesh"] if plan.tensor_parallel else [])
    try:
        dims = parallel_dims(mesh)
    except ValueError as e:
        return problems + [str(e)]
    for what, m in (("device_mesh", mesh), ("moe_mesh", moe_mesh)):
        if isinstance(m, DeviceMesh) and m.get_coordinate() is None:
            # torch fails deep inside fully_shard (an IndexError) after the
            # first units were already sharded.
            problems.append(
                f"{what} spans ranks {m.mesh.flatten().tolist()} but this process is rank "
                f"{_global_rank()}, which is not in it; build the mesh over every rank that runs this model"
            )
    tp = plan.tensor_parallel
    if tp is not None and tp.assignments:
        if dims.tp == 1:
            problems.append("the plan has tensor parallelism but the mesh has no tp dim of size > 1")
        else:
            problems.extend(check_tensor_parallel(tp, model, dims.tp, index=index))
            named = index.params.items() if index is not None else model.named_parameters()
            already = sorted(f for f, p in named if isinstance(p, DTensor))
            if already:
                problems.append(
                    f"the model is already parallelized: {preview(already)} are DTensors; "
                    "build a fresh model and apply the plan once"
                )
    if any(u.mesh == "moe" for u in plan.units) and moe_mesh is None:
        moe = [u.modules[0] for u in plan.units if u.mesh == "moe"]
        problems.append(f"units for expert modules {preview(moe)} need moe_mesh=, which was not given")
    elif moe_mesh is not None:
        try:
            moe_dp_dims(moe_mesh, mesh)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    problems.extend(expert_parallel_problems(plan, model, moe_mesh, hand))
    sized = [(i, u) for i, u in enumerate(plan.units) if type(u.reshard_after_forward) is int]
    problems.extend(
        f"unit {i} ({join_names(u.modules)}): reshard_after_forward={u.reshard_after_forward} "
        f"does not divide the shard dimension of the mesh ({dims.dp_shard})"
        for i, u in sized
        if dims.dp_shard % u.reshard_after_forward  # type: ignore[operator]
    )
    return problems


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _offload_problems(plan: Plan) -> list[str]:
    """A CPU offload policy that pins memory needs an accelerator: pinning
    is page-locking host memory for fast copies to a device, and torch
    refuses it (in ``pin_memory``, after TP and earlier units were already
    applied) on a host without one."""
    pinned = [i for i, u in enumerate(plan.units) if getattr(u.offload_policy, "pin_memory", False)]
    if not pinned or torch.accelerator.is_available():
        return []
    return [
        f"units {preview([str(i) for i in pinned])} offload with CPUOffloadPolicy(pin_memory=True), but this "
        "host has no accelerator to pin memory for; use CPUOffloadPolicy(pin_memory=False)"
    ]


def check_checkpointing(ac: Checkpointing | None, find: Callable[[str], nn.Module]) -> list[str]:
    if ac is None:
        return []
    problems: list[str] = []
    done: list[str] = []
    for fqn in ac.modules:
        try:
            module = find(fqn)
        except AttributeError:
            problems.append(f"checkpointed module {fqn!r} does not exist")
            continue
        if is_checkpointed(module):
            done.append(fqn)
    if done:
        problems.append(f"modules {preview(done)} already have activation checkpointing")
    return problems


def check_kv_cache(ac: Checkpointing | None, model: nn.Module, index: ModelIndex | None) -> list[str]:
    """A KV cache that is on now but was off at planning: the model changed
    since the Plan was made (checkpointing would turn off a switch the Plan
    does not show), so the Plan no longer says what applying does."""
    if ac is None:
        return []
    now = kv_cache_switches(model.named_modules() if index is None else index.modules.items())
    new = [switch for switch in now if switch not in ac.kv_cache_off]
    if not new:
        return []
    return [
        f"{preview(new)} is on, but was off when the plan was made: the model changed since planning "
        "(checkpointing would turn it off, which the plan does not show); re-plan, or set it back to False"
    ]


def check_prefetch(plan: Plan) -> list[str]:
    heads = {u.modules[0] for u in plan.units if len(u.modules) == 1}
    return [
        f"prefetch chain names {m!r}, which is not a single-module unit of the plan"
        for c in plan.prefetch
        for m in (c.unit, *c.forward, *c.backward)
        if m not in heads
    ]
