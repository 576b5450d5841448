"""The one effectful step: check a Plan against a model, then shard it.

Every check runs before the first call of the sharding primitive, so bad input
never leaves a model half-sharded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint  # type: ignore[attr-defined]
from torch.distributed._composable.contract import _get_registry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, _CachedTorchDispatchMode, create_selective_checkpoint_contexts

from ..core._args import require_module
from ..tp._marks import exclude_from_tp_replica_sync, mark_parameter_reductions
from ..core._names import join_names
from ..core._meshes import ep_size, fsdp_mesh, moe_dp_dims, moe_fsdp_mesh, parallel_dims, tp_mesh
from ..model._index import ModelIndex
from ..model._unit_checks import module_problems
from ..plan._json import described_style_problems
from ..plan._resolve import claim
from ..plan._types import Checkpointing, Plan, Unit, marks_under_exclusions, preview
from ..plan._vouch import MarkTargets, reductions_by_module, settings_problems, vouched_modules
from ._experts import HandEpMesh, divide_expert_gradients, expert_parallel_problems, hand_ep_mesh, split_experts
from ._inputs import cast_inputs_to_fp32, wholly_fp32_modules
from ._unused import configure_units_of
from ..core._policy import primitive_policy
from ..core._tree import get_module_from_path
from ..tp._transform import check_tensor_parallel, tied_tp_groups, tp_styles_by_module

__all__ = [
    "PlanMismatchError",
    "apply_indexed",
    "apply_plan",
    "apply_resolved",
    "check_plan",
    "check_resolved",
    "require_mesh",
    "shard_kwargs",
]

logger = logging.getLogger(__name__)

ShardModule = Callable[..., Any]
ParallelizeModule = Callable[..., Any]
CheckpointModule = Callable[..., Any]


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


def _fail(problems: list[str]) -> None:
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
    return _checked(plan, model)[0]


def _checked(
    plan: Plan, model: nn.Module, index: ModelIndex | None = None
) -> tuple[list[list[nn.Module]], MarkTargets | None]:
    """:func:`check_plan`'s modules, and the modules the marks go to when a
    vouched plan's walk found them (else ``None``: looked up by FQN).
    ``index``: the model's index as it is now, read instead of walking the
    model again."""
    vouched = vouched_modules(plan, model, None if index is None else index.walk)
    if vouched is not None:
        return vouched
    return _check_in_full(plan, model, index if index is not None else ModelIndex.build(model)), None


def check_resolved(plan: Plan, resolved: list[list[nn.Module]]) -> list[list[nn.Module]]:
    """The checks left for units just resolved from the model as it is
    (their claims hold): what the primitive would refuse in each unit's
    settings and modules. Returns ``resolved``."""
    problems: list[str] = []
    for i, (unit, mods) in enumerate(zip(plan.units, resolved)):
        problems.extend(settings_problems(i, unit))
        problems.extend(module_problems(i, unit.modules, mods))
    _fail(problems)
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
    _fail(problems)  # past here every unit module exists and passed module_problems

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
    _fail(problems)
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


def _check_against_mesh(
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
    import torch

    pinned = [i for i, u in enumerate(plan.units) if getattr(u.offload_policy, "pin_memory", False)]
    if not pinned or torch.accelerator.is_available():
        return []
    return [
        f"units {preview([str(i) for i in pinned])} offload with CPUOffloadPolicy(pin_memory=True), but this "
        "host has no accelerator to pin memory for; use CPUOffloadPolicy(pin_memory=False)"
    ]


def _check_checkpointing(ac: Checkpointing | None, find: Callable[[str], nn.Module]) -> list[str]:
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
        if _is_checkpointed(module):
            done.append(fqn)
    if done:
        problems.append(f"modules {preview(done)} already have activation checkpointing")
    return problems


def turn_kv_cache_off(model: nn.Module, modules: Iterable[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Set every ``use_cache`` that is on to ``False``; returns where (paths
    such as ``model.config.use_cache``).

    A forward that fills a KV cache recomputes a different op sequence in
    backward than it ran (the cache has grown by then), which checkpointing
    cannot replay; a training forward never needs the cache. Hugging Face's
    own gradient checkpointing and the reference turn it off the same way.
    Each distinct config object the modules hold is visited (a multimodal
    model's language model reads its text config, not the top-level one).
    ``modules``: the model's ``(FQN, module)`` pairs, when the caller has
    them from an index (default ``model.named_modules()``)."""
    changed: list[str] = []
    seen: set[int] = set()
    for fqn, module in model.named_modules() if modules is None else modules:
        config = module.__dict__.get("config")
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            changed.append(f"model.{fqn}.config.use_cache" if fqn else "model.config.use_cache")
    return changed


def _turn_kv_cache_off(model: nn.Module, index: ModelIndex | None) -> None:
    """:func:`turn_kv_cache_off`, with a warning naming each switch."""
    for path in turn_kv_cache_off(model, None if index is None else index.modules.items()):
        logger.warning(
            "activation checkpointing: set %s = False (a KV cache filled in a checkpointed forward "
            "cannot be recomputed in backward)",
            path,
        )


def _is_checkpointed(module: nn.Module) -> bool:
    """Composable ``checkpoint`` registers itself on the module; the wrapper
    API puts the block inside a ``_checkpoint_wrapped_module``."""
    return "checkpoint" in (_get_registry(module) or {}) or "_checkpoint_wrapped_module" in module._modules


def _check_prefetch(plan: Plan) -> list[str]:
    heads = {u.modules[0] for u in plan.units if len(u.modules) == 1}
    return [
        f"prefetch chain names {m!r}, which is not a single-module unit of the plan"
        for c in plan.prefetch
        for m in (c.unit, *c.forward, *c.backward)
        if m not in heads
    ]




def shard_kwargs(unit: Unit, mesh: object) -> dict[str, Any]:
    """Keyword arguments for the primitive. ``reshard_after_forward=None`` and a
    ``None`` offload policy are left out so the primitive's defaults apply; a
    ``None`` mixed-precision policy becomes ``MixedPrecisionPolicy()``."""
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": primitive_policy(unit.mp_policy)}
    if unit.offload_policy is not None:
        kwargs["offload_policy"] = unit.offload_policy
    if unit.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = unit.reshard_after_forward
    return kwargs


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


def _live_param(find: Callable[[str], nn.Module], fqn: str) -> nn.Parameter:
    """Look a parameter up now: sharding an earlier unit may have replaced it."""
    module_fqn, _, name = fqn.rpartition(".")
    p = find(module_fqn)._parameters[name]
    assert p is not None
    return p


# Ops whose outputs selective checkpointing keeps: the costly ones
# (matrix multiplications, attention). Everything else (elementwise ops,
# norms, activations) is cheap to recompute and is not kept.
_SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if str(op) in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeMode(_CachedTorchDispatchMode):
    """Selective checkpointing's replay, letting profiler ops through.

    Composable ``checkpoint`` sits on the module FSDP shards, and FSDP's
    pre-forward hook runs before checkpointing starts in forward but inside
    the replay in backward; its ``record_function`` ranges (the input cast
    of a bf16 policy) would then be ops the replay never saw and fail it.
    They compute nothing, so they run as they are.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "profiler":
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]


def _selective_context() -> tuple[Any, Any]:
    caching, cached = create_selective_checkpoint_contexts(_selective_policy)
    return caching, _RecomputeMode(_selective_policy, cached.storage)


def _retie(find: Callable[[str], nn.Module], groups: list[list[tuple[str, str]]]) -> None:
    """Share one parameter again in each tied group after TP replaced each
    module's copy (equal values: both came from the same tensor)."""
    for group in groups:
        (first_module, first_name), *rest = group
        shared = find(first_module)._parameters[first_name]
        for fqn, name in rest:
            find(fqn).register_parameter(name, shared)


def _fsdp_meshes(plan: Plan, mesh: object, moe_mesh: DeviceMesh | None) -> tuple[object, object]:
    if not plan.units:
        return mesh, None
    dense = fsdp_mesh(mesh) if isinstance(mesh, DeviceMesh) else mesh
    moe = moe_fsdp_mesh(moe_mesh, mesh) if moe_mesh is not None and isinstance(mesh, DeviceMesh) else None
    return dense, moe


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
    require_mesh(mesh, shard_module, "apply_plan")
    if moe_mesh is not None and not isinstance(moe_mesh, DeviceMesh):
        raise TypeError(f"apply_plan: moe_mesh must be a torch DeviceMesh or None, got {type(moe_mesh).__name__}")
    resolved, marks = _checked(plan, model, index)
    return apply_resolved(
        plan,
        model,
        mesh,
        resolved,
        marks=marks,
        index=index,
        moe_mesh=moe_mesh,
        shard_module=shard_module,
        parallelize_module=parallelize_module,
        checkpoint_module=checkpoint_module,
        hand_ep_mesh=hand_ep_mesh,
    )


def apply_resolved(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    resolved: list[list[nn.Module]],
    *,
    marks: MarkTargets | None = None,
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
    model's index as it is now; see :func:`_finder`)."""
    find = _finder(model, index)
    _fail(described_style_problems(plan))  # before the TP checks, which read the styles
    problems = _check_against_mesh(plan, model, mesh, moe_mesh, index, hand_ep_mesh)
    problems += _check_checkpointing(plan.checkpointing, find)
    problems += _check_prefetch(plan)
    _fail(problems)
    dense, moe = _fsdp_meshes(plan, mesh, moe_mesh)

    tp = plan.tensor_parallel
    tp_group = tp_mesh(mesh) if isinstance(mesh, DeviceMesh) else None
    if tp is not None and tp.assignments:
        tied, _problems = tied_tp_groups(tp, model, index=index)  # the problems were refused above
        named = index.params.items() if index is not None else model.named_parameters()
        frozen = [name for name, p in named if not p.requires_grad]
        parallelize_module(model, tp_group, tp_styles_by_module(tp))
        _retie(find, tied)
        _refreeze(find, frozen)
    if plan.checkpointing is not None:
        _turn_kv_cache_off(model, index)
        extra = {"context_fn": _selective_context} if plan.checkpointing.mode == "selective" else {}
        for fqn in plan.checkpointing.modules:
            checkpoint_module(find(fqn), **extra)
    if plan.expert_parallel is not None and moe_mesh is not None:
        split_experts(model, plan.expert_parallel, moe_mesh, hand_ep_mesh)
    compute_of = {name: unit.compute_dtype for unit in plan.units for name in unit.params}
    fp32_modules = wholly_fp32_modules(
        ((unit.modules, mods, unit.compute_dtype) for unit, mods in zip(plan.units, resolved)), compute_of
    )
    for unit, mods in zip(plan.units, resolved):
        kwargs = shard_kwargs(unit, moe if unit.mesh == "moe" else dense)
        if unit.ignored_params:
            kwargs["ignored_params"] = {_live_param(find, f) for f in unit.ignored_params}
        shard_module(mods[0] if len(mods) == 1 else mods, **kwargs)
        if unit.mesh == "moe" and moe_mesh is not None and ep_size(moe_mesh) > 1:
            divide_expert_gradients(mods, moe_mesh, moe)
    for module in fp32_modules:
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
        _check_sequence_length(model, tp_group.size())
    return model


def _refreeze(find: Callable[[str], nn.Module], frozen: list[str]) -> None:
    """Freeze again what was frozen before tensor parallelism: torch's
    ``SequenceParallel`` re-registers a norm's parameters as new, trainable
    ones, and a frozen norm would otherwise train."""
    for fqn in frozen:
        module_fqn, _, name = fqn.rpartition(".")
        p = find(module_fqn)._parameters[name]
        assert p is not None
        p.requires_grad_(False)


def _check_sequence_length(model: nn.Module, tp_size: int) -> None:
    """Refuse, before the first collective of a forward (this hook runs
    before FSDP's), a sequence that does not split evenly over the TP ranks:
    DTensor would shard it unevenly and the ranks would disagree on every
    shape after. The sequence is dim 1 of the first positional tensor, or
    of ``input_ids`` / ``inputs_embeds``."""

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        del module
        found = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if found is None:
            found = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if isinstance(kwargs.get(k), torch.Tensor)), None)
        if found is not None and found.dim() >= 2 and found.shape[1] % tp_size:
            raise ValueError(
                f"sequence parallelism: the input's sequence length {found.shape[1]} is not divisible by the "
                f"tensor-parallel size {tp_size}; pad or cut the batch to a multiple of {tp_size} positions"
            )

    model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
