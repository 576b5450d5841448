"""The one effectful step: check a Plan against a model, then carry it out.

Every check (:mod:`._check`) runs before the first mutation, so bad input
never leaves a model half-parallelized. Then, in one fixed order: tensor
parallelism (:mod:`._tp` mends what it leaves), activation checkpointing
(:mod:`._checkpoint`), expert parallelism (:mod:`._experts`), the FSDP units
(:mod:`._fsdp`), fp32 inputs for wholly fp32 modules (:mod:`._inputs`),
prefetch chains, unused-parameter reduction (:mod:`._unused`) and the
TP-replica marks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

from ..core._args import require_callable, require_module
from ..core._torch_internals import composable_checkpoint
from ..tp._marks import exclude_from_tp_replica_sync, mark_parameter_reductions
from ..core._meshes import ep_size, tp_mesh
from ..model._index import ModelIndex
from ..plan._json import described_style_problems
from ..plan._plan import Plan
from ..plan._vouch import MarkTargets, reductions_by_module
from ._experts import HandEpMesh, divide_expert_gradients, hand_ep_mesh, split_experts
from ..plan._fp32_inputs import wholly_fp32_modules
from ._inputs import cast_inputs_to_fp32
from ._unused import configure_units_of
from ..core._tree import get_module_from_path
from ..tp._transform import tied_tp_groups, tp_styles_by_module
from ._check import (
    check_against_mesh,
    check_checkpointing,
    check_kv_cache,
    check_prefetch,
    checked_units,
    fail,
    require_mesh,
)
from ._checkpoint import selective_context, turn_kv_cache_off_warning
from ._tp import check_sequence_length, refreeze, retie
from ._fsdp import fsdp_meshes, live_param, shard_kwargs

__all__ = [
    "CheckpointModule",
    "ParallelizeModule",
    "ShardModule",
    "apply_indexed",
    "apply_plan",
    "apply_resolved",
    "precheck",
]

ShardModule = Callable[..., Any]
ParallelizeModule = Callable[..., Any]
CheckpointModule = Callable[..., Any]


def _finder(model: nn.Module, index: ModelIndex | None) -> Callable[[str], nn.Module]:
    """Module lookup by FQN: from ``index`` (a table, not a climb down the
    path) when the caller has the model's index, else from ``model``. The
    effects replace parameters, never modules, so an index built before
    them still finds every module; an FQN it lacks is climbed for, so the
    error names the path and segment."""
    if index is None:
        return functools.partial(get_module_from_path, model)
    modules = index.modules

    def find(fqn: str) -> nn.Module:
        found = modules.get(fqn)
        return found if found is not None else get_module_from_path(model, fqn)

    return find


def apply_plan(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    moe_mesh: DeviceMesh | None = None,
    shard_module: ShardModule = fully_shard,
    parallelize_module: ParallelizeModule = torch_parallelize_module,
    checkpoint_module: CheckpointModule = composable_checkpoint,
    hand_ep_mesh: HandEpMesh = hand_ep_mesh,
) -> nn.Module:
    """Carry out ``plan`` on ``model``; returns ``model``.

    Everything is checked first (units against the model, policies, mesh
    dims, TP patterns and divisibility, checkpointed and prefetched
    modules); on any problem a :class:`PlanMismatchError` lists them all and
    the model is untouched. Then, in this fixed order: tensor parallelism
    (one ``parallelize_module`` call on the ``tp`` submesh), activation
    checkpointing, expert parallelism (each expert weight split ``Shard(0)``
    across ``moe_mesh``'s ``ep`` dim, then ``hand_ep_mesh(expert_module,
    ep_mesh)``, by default the module's ``set_expert_parallel_mesh``), one
    ``shard_module`` call per FSDP unit in plan order (a list of modules
    for a multi-module unit; expert units on ``moe_mesh``'s data-parallel
    dims, HSDP where one replicates, their gradients divided by ``ep`` x
    those dims under expert parallelism), prefetch chains, unused-parameter
    reduction, then the TP-replica reduction marks and exclusions.

    ``mesh`` is read by dim names (``dp_replicate``, ``dp_shard``/``dp``,
    ``cp``, ``tp``, ``pp``); FSDP shards over the data-parallel dims with
    ``cp`` folded in (HSDP when ``dp_replicate`` is present). Each effect is
    an argument with torch's default, so tests can record calls and other
    frameworks substitute their own.

    Args:
        plan: the Plan to carry out (from :func:`fsdptx.plan` or a plan file).
        model: the model it was planned for.
        mesh: the device mesh, read by dim names.
        moe_mesh: the mesh expert units shard over; needed when the plan has
            expert units.
        shard_module: the FSDP primitive (``fully_shard``).
        parallelize_module: the TP primitive (``parallelize_module``).
        checkpoint_module: the activation-checkpoint primitive (torch's
            composable ``checkpoint``).
        hand_ep_mesh: tells an expert module its ``ep`` mesh under expert
            parallelism (default: its ``set_expert_parallel_mesh``).

    Returns:
        ``model``, parallelized in place.

    Raises:
        TypeError: ``plan`` is not a Plan, or ``moe_mesh`` not a mesh.
        PlanMismatchError: the plan does not fit the model or the mesh;
            nothing was changed.

    Example::

        p = fsdptx.plan(model, pipeline, mp_policy=policy)
        fsdptx.apply_plan(p, model, mesh["dp"])
    """
    return apply_indexed(
        plan,
        model,
        mesh,
        None,
        moe_mesh=moe_mesh,
        shard_module=shard_module,
        parallelize_module=parallelize_module,
        checkpoint_module=checkpoint_module,
        hand_ep_mesh=hand_ep_mesh,
    )


def apply_indexed(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    index: ModelIndex | None,
    *,
    moe_mesh: DeviceMesh | None = None,
    shard_module: ShardModule = fully_shard,
    parallelize_module: ParallelizeModule = torch_parallelize_module,
    checkpoint_module: CheckpointModule = composable_checkpoint,
    hand_ep_mesh: HandEpMesh = hand_ep_mesh,
) -> nn.Module:
    """:func:`apply_plan` reading ``index``, the model's index as it is now
    (``None``: walk the model). ``FSDP2Manager.parallelize`` hands on the
    index its planning built a moment ago, so every check and effect reads
    that one walk: the vouched plan's signature is compared with it, or the
    full check re-derives every unit's claims from it."""
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_plan: plan must be an fsdptx.Plan, got {type(plan).__name__}")
    require_module(model, "model", "apply_plan")
    if plan.pipeline is not None:
        raise ValueError(
            "apply_plan: this Plan has pipeline stages; apply it with fsdptx.apply_pipeline(plan, model, mesh, "
            "loss_fn=...), which builds this rank's stages (FSDP2Manager.parallelize does)"
        )
    for argument, primitive in (
        ("shard_module", shard_module),
        ("parallelize_module", parallelize_module),
        ("checkpoint_module", checkpoint_module),
        ("hand_ep_mesh", hand_ep_mesh),
    ):
        require_callable(primitive, argument, "apply_plan")
    require_mesh(mesh, shard_module, "apply_plan")
    if moe_mesh is not None and not isinstance(moe_mesh, DeviceMesh):
        raise TypeError(f"apply_plan: moe_mesh must be a torch DeviceMesh or None, got {type(moe_mesh).__name__}")
    resolved, marks, fp32_inputs = checked_units(plan, model, index)
    return apply_resolved(
        plan,
        model,
        mesh,
        resolved,
        marks=marks,
        fp32_inputs=fp32_inputs,
        index=index,
        moe_mesh=moe_mesh,
        shard_module=shard_module,
        parallelize_module=parallelize_module,
        checkpoint_module=checkpoint_module,
        hand_ep_mesh=hand_ep_mesh,
    )


def precheck(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    index: ModelIndex | None,
    *,
    moe_mesh: DeviceMesh | None = None,
    hand_ep_mesh: HandEpMesh = hand_ep_mesh,
) -> None:
    """The checks of a Plan against the mesh, its styles, checkpointed and
    prefetched modules, run before any effect; raises
    :class:`PlanMismatchError` listing every problem. Applying a pipelined
    Plan runs it for every stage before the first stage changes."""
    fail(described_style_problems(plan))  # before the TP checks, which read the styles
    problems = check_against_mesh(plan, model, mesh, moe_mesh, index, hand_ep_mesh)
    problems += check_checkpointing(plan.checkpointing, _finder(model, index))
    problems += check_kv_cache(plan.checkpointing, model, index)
    problems += check_prefetch(plan)
    fail(problems)


def apply_resolved(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    resolved: list[list[nn.Module]],
    *,
    marks: MarkTargets | None = None,
    fp32_inputs: list[nn.Module] | None = None,
    index: ModelIndex | None = None,
    moe_mesh: DeviceMesh | None = None,
    shard_module: ShardModule = fully_shard,
    parallelize_module: ParallelizeModule = torch_parallelize_module,
    checkpoint_module: CheckpointModule = composable_checkpoint,
    hand_ep_mesh: HandEpMesh = hand_ep_mesh,
) -> nn.Module:
    """:func:`apply_plan` once the units are checked against the model and
    ``resolved`` holds each unit's modules: the mesh, checkpointing and
    prefetch checks, then the effects. The imperative API comes here
    directly, its units resolved from the index it has just built.
    ``marks`` holds the modules the marks go to when they are known
    already; else they are looked up by FQN, in ``index`` when given (the
    model's index as it is now; see :func:`_finder`). ``fp32_inputs``
    likewise holds the modules whose inputs are cast to fp32, as a vouched
    plan recorded them; else they are found from the units and the model."""
    find = _finder(model, index)
    precheck(plan, model, mesh, index, moe_mesh=moe_mesh, hand_ep_mesh=hand_ep_mesh)
    dense, moe = fsdp_meshes(plan, mesh, moe_mesh)

    tp = plan.tensor_parallel
    tp_group = tp_mesh(mesh) if isinstance(mesh, DeviceMesh) else None
    if tp is not None and tp.assignments:
        tied, _problems = tied_tp_groups(tp, model, index=index)  # the problems were refused above
        named = index.params.items() if index is not None else model.named_parameters()
        frozen = [name for name, p in named if not p.requires_grad]
        parallelize_module(model, tp_group, tp_styles_by_module(tp))
        retie(find, tied)
        refreeze(find, frozen)
    if plan.checkpointing is not None:
        turn_kv_cache_off_warning(model, index)
        extra = {"context_fn": selective_context} if plan.checkpointing.mode == "selective" else {}
        for fqn in plan.checkpointing.modules:
            checkpoint_module(find(fqn), **extra)
    if plan.expert_parallel is not None and moe_mesh is not None:
        split_experts(model, plan.expert_parallel, moe_mesh, hand_ep_mesh)
    if fp32_inputs is None:
        fp32_inputs = wholly_fp32_modules(
            ((unit.modules, mods, unit.params, unit.compute_dtype) for unit, mods in zip(plan.units, resolved)), index
        )
    for unit, mods in zip(plan.units, resolved):
        kwargs = shard_kwargs(unit, moe if unit.mesh == "moe" else dense)
        if unit.ignored_params:
            kwargs["ignored_params"] = {live_param(find, f) for f in unit.ignored_params}
        shard_module(mods[0] if len(mods) == 1 else mods, **kwargs)
        if unit.mesh == "moe" and moe_mesh is not None and ep_size(moe_mesh) > 1:
            divide_expert_gradients(mods, moe_mesh, moe)
    for module in fp32_inputs:
        cast_inputs_to_fp32(module)
    for chain in plan.prefetch:
        unit_module = find(chain.unit)
        if isinstance(unit_module, FSDPModule):
            if chain.forward:
                unit_module.set_modules_to_forward_prefetch([find(m) for m in chain.forward])  # type: ignore[misc]
            if chain.backward:
                unit_module.set_modules_to_backward_prefetch([find(m) for m in chain.backward])  # type: ignore[misc]
    if plan.reduce_unused_params:
        configure_units_of(model.modules() if index is None else index.walk.modules)
    if marks is None:
        marks = (
            [(find(f), m) for f, m in reductions_by_module(plan.reductions).items()],
            [find(f) for f in plan.exclusions],
        )
    reduced, excluded = marks
    for module, reductions in reduced:
        mark_parameter_reductions(module, reductions)
    for module in excluded:
        exclude_from_tp_replica_sync(module)
    if tp is not None and tp.sequence_parallel and tp.assignments and tp_group is not None:
        check_sequence_length(model, tp_group.size())
    return model
