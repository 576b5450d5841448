"""Expert parallelism at apply time: check the plan's EP request against
the model and the MoE mesh, then split the expert weights across ``ep``.

The split follows the pattern torchtitan uses for MoE models: each expert
weight (``[num_experts, ...]``) becomes a DTensor ``Shard(0)`` on the 1-D
``ep`` mesh, so an EP rank holds whole experts; FSDP later shards that
local block over the MoE mesh's data-parallel dims (torch composes the two
into one DTensor over both). Routing tokens to the rank holding their
expert stays in the model: each expert module is handed its ``ep`` mesh.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..core._meshes import ep_mesh, ep_size, moe_gradient_divide_factor
from ..model._index import STAGE_MODEL_ATTRIBUTE, ModelNames
from ..hf._expert_parallel import hf_dispatches_experts, install_hf_expert_dispatch
from ..plan.transforms import EP_HOOK, uneven_experts
from ..plan._plan import Plan
from ..plan._types import ExpertParallel, preview

__all__ = [
    "HandEpMesh",
    "dispatches",
    "divide_expert_gradients",
    "expert_parallel_problems",
    "hand_ep_mesh",
    "split_experts",
]

HandEpMesh = Callable[[nn.Module, DeviceMesh], object]


def hand_ep_mesh(module: nn.Module, mesh: DeviceMesh) -> None:
    """Tell an expert module its ``ep`` mesh (the default way ``apply_plan``
    tells a model its EP group): through its :data:`EP_HOOK` method, else,
    for a transformers experts module, by installing transformers' own
    token dispatch (:func:`~fsdptx.hf._expert_parallel.install_hf_expert_dispatch`)."""
    hook = getattr(module, EP_HOOK, None)
    if callable(hook):
        hook(mesh)
    else:
        install_hf_expert_dispatch(module, mesh)


def dispatches(module: nn.Module) -> bool:
    """Whether :func:`hand_ep_mesh` can tell ``module`` its ``ep`` mesh."""
    return callable(getattr(module, EP_HOOK, None)) or hf_dispatches_experts(module)


def expert_parallel_problems(
    plan: Plan, model: nn.Module, moe_mesh: DeviceMesh | None, hand: HandEpMesh
) -> list[str]:
    """What would make expert parallelism fail or compute a wrong result,
    found before anything is changed.

    A MoE mesh with ``ep`` > 1 needs the plan's EP request (else each EP
    rank would hold every expert, train it on its own tokens, and never
    reduce its gradients with the other EP ranks'), but on a pipeline stage
    holding no experts (the dense first blocks of a DeepSeek-V3), and the
    request needs
    such a mesh. Each expert count must divide by ``ep``; each expert
    module must still have the planned parameters and expert count, hold
    no DTensor yet, not be split by tensor parallelism too, belong to units
    on the MoE mesh, and (with the default ``hand``) be one it can tell its
    ``ep`` mesh (:func:`dispatches`).
    """
    ep = plan.expert_parallel
    size = ep_size(moe_mesh)
    names = dict(zip(moe_mesh.mesh_dim_names or (), moe_mesh.shape)) if moe_mesh is not None else {}
    if ep is None:
        dense_stage = not plan.expert_modules and isinstance(getattr(model, STAGE_MODEL_ATTRIBUTE, None), ModelNames)
        if size > 1 and not dense_stage:  # a pipeline stage of dense blocks has no experts to split
            return [
                f"moe_mesh {names} has ep={size}, but the plan does not split experts across it: each ep rank "
                "would train every expert on its own tokens and never reduce their gradients across ep; add "
                "fsdptx.expert_parallel to the pipeline (FSDP2Manager does when its moe_mesh has ep > 1)"
            ]
        return []
    if size == 1:
        where = f"moe_mesh {names} has no ep dim of size > 1" if moe_mesh is not None else "no moe_mesh was given"
        return [
            f"the plan splits experts {preview(ep.modules)} across the moe mesh's ep dim, but {where}; pass "
            "moe_mesh= with an 'ep' dim > 1, or plan without fsdptx.expert_parallel"
        ]
    problems: list[str] = []
    uneven = uneven_experts(ep, size)
    if uneven is not None:
        problems.append(uneven)
    modules = dict(model.named_modules())
    missing = [m for m in ep.modules if m not in modules]
    if missing:
        problems.append(f"expert modules {preview(missing)} do not exist in {type(model).__name__}; re-plan")
    params = dict(model.named_parameters())
    gone = [p for p in ep.params if p not in params]
    if gone:
        problems.append(f"expert parameters {preview(gone)} do not exist in {type(model).__name__}; re-plan")
    counts = dict(zip(ep.modules, ep.num_experts))
    changed = [
        p
        for p in ep.params
        if p in params and (params[p].dim() == 0 or params[p].shape[0] != counts[_owner(p, ep.modules)])
    ]
    if changed:
        problems.append(f"expert parameters {preview(changed)} no longer have the planned expert count on dim 0; re-plan")
    split = [p for p in ep.params if isinstance(params.get(p), DTensor)]
    if split:
        problems.append(f"expert parameters {preview(split)} are DTensors already; build a fresh model and apply once")
    tp = plan.tensor_parallel
    if tp is not None:
        both = [a.module for a in tp.assignments if any(_within(a.module, m) for m in ep.modules)]
        if both:
            problems.append(
                f"modules {preview(both)} are split by tensor parallelism inside expert modules that expert "
                "parallelism splits by expert; keep the experts out of the TP plan"
            )
    owner = plan.owned_params
    dense = [p for p in ep.params if p in owner and plan.units[owner[p]].mesh != "moe"]
    if dense:
        problems.append(
            f"expert parameters {preview(dense)} belong to units on the dense mesh; plan the expert modules as "
            "units of their own (shard_by_dtype(expert_modules=...)) so FSDP shards them over the moe mesh"
        )
    if hand is hand_ep_mesh:
        hookless = [m for m in ep.modules if m in modules and not dispatches(modules[m])]
        if hookless:
            problems.append(
                f"expert modules {preview(hookless)} define no {EP_HOOK}(ep_mesh) and are not transformers "
                "experts, so their forward cannot send tokens to the ep rank holding their expert and would run "
                "only the local experts; add that method (and the all-to-all dispatch over "
                "ep_mesh.get_group() in forward)"
            )
    return problems


def _within(fqn: str, module: str) -> bool:
    return fqn == module or not module or fqn.startswith(module + ".")


def _owner(param: str, modules: tuple[str, ...]) -> str:
    """The expert module holding ``param`` (the innermost, should they nest)."""
    return max((m for m in modules if _within(param, m)), key=len)


def split_experts(model: nn.Module, ep: ExpertParallel, moe_mesh: DeviceMesh, hand: HandEpMesh = hand_ep_mesh) -> None:
    """Make each expert parameter a DTensor ``Shard(0)`` on ``moe_mesh``'s
    ``ep`` dim, then hand each expert module that mesh.

    Each rank cuts its own block from its own copy (no communication, as
    ``fully_shard`` does): the ranks must hold equal initial weights, as
    they must for FSDP. Frozen parameters stay frozen."""
    mesh = ep_mesh(moe_mesh)
    for fqn in ep.params:
        module_fqn, _, name = fqn.rpartition(".")
        module = model.get_submodule(module_fqn)
        param = module._parameters[name]
        assert param is not None  # expert_parallel_problems found every planned parameter
        split = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
    for fqn in ep.modules:
        hand(model.get_submodule(fqn), mesh)


def divide_expert_gradients(modules: list[nn.Module], moe_mesh: DeviceMesh, fsdp_mesh: object) -> None:
    """Set the gradient divide factor of FSDP expert units under expert
    parallelism to :func:`~fsdptx.core._meshes.moe_gradient_divide_factor`
    (``ep`` included), so expert gradients are means over the same ranks
    as dense ones. A substituted primitive's modules are left alone.

    FSDP applies a custom factor with a pre-multiplied-sum reduce-scatter,
    which gloo (the CPU backend) lacks, so on a CPU mesh the reduction is a
    plain sum with the division done apart. Not when ``fsdp_mesh``'s shard
    dim has one rank: FSDP then skips the reduce-scatter and divides once
    while copying, and forcing the sum would divide a second time."""
    factor = moe_gradient_divide_factor(moe_mesh)
    shards = fsdp_mesh.size(fsdp_mesh.ndim - 1) if isinstance(fsdp_mesh, DeviceMesh) else 1
    for module in modules:
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(factor))
            if moe_mesh.device_type == "cpu" and shards > 1:
                module.set_force_sum_reduction_for_comms(True)
