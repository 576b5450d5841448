"""Expert parallelism on fake meshes: where the expert weights land, what
the plan shows, which meshes and models are refused before anything
changes, and which expert parameters count as TP replicas."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh
from moe_ep_model import EXPERTS, TinyMoE, build

EXPERT_PARAMS = ("layers.0.experts.w1", "layers.0.experts.w2", "layers.1.experts.w1", "layers.1.experts.w2")


def _parallelize(shape: tuple[int, ...], names: tuple[str, ...], moe: dict[str, int], model: nn.Module | None = None, **config: Any) -> nn.Module:
    model = build() if model is None else model
    with fake_mesh(shape, names) as mesh:
        moe_mesh = init_device_mesh("cpu", tuple(moe.values()), mesh_dim_names=tuple(moe))
        FSDP2Manager(FSDP2Config(mp_policy=None, **config), mesh, moe_mesh=moe_mesh).parallelize(model)
        return model


@pytest.mark.parametrize(
    ("shape", "names", "moe", "fsdp_dims"),
    [
        ((4,), ("dp",), {"dp_shard": 2, "ep": 2}, ("dp_shard",)),
        ((2, 4), ("dp_replicate", "dp_shard"), {"dp_replicate": 2, "dp_shard": 2, "ep": 2}, ("dp_replicate", "dp_shard")),
        ((8,), ("dp",), {"ep_replicate": 2, "ep_shard": 2, "ep": 2}, ("ep_replicate", "ep_shard")),
        ((2, 4), ("dp_replicate", "dp_shard"), {"dp_replicate": 2, "ep": 4}, ("dp_replicate",)),
        ((2, 2, 2), ("dp_replicate", "dp_shard", "cp"), {"dp_replicate": 2, "dp_shard": 1, "cp": 2, "ep": 2}, ("dp_replicate", "dp_shard", "cp")),
    ],
    ids=["fsdp", "hsdp", "hsdp-ep-names", "hsdp-replicate-only", "hsdp-flattened-shard-dims"],
)
def test_experts_are_shard0_over_ep_and_fsdp_uses_the_remaining_dp_dims(
    shape: tuple[int, ...], names: tuple[str, ...], moe: dict[str, int], fsdp_dims: tuple[str, ...]
) -> None:
    model = _parallelize(shape, names, moe)
    replicate = [d for d in fsdp_dims if d.endswith("_replicate")]
    shard = math.prod(moe[d] for d in fsdp_dims if d not in replicate)
    for fqn in EXPERT_PARAMS:
        p = model.get_parameter(fqn)
        assert isinstance(p, DTensor)
        mesh_names = tuple(p.device_mesh.mesh_dim_names or ())
        # FSDP's dims first (HSDP: the replicate dim kept as its own dim), then ep
        assert mesh_names[-1] == "ep" and p.placements[-1] == Shard(0), (mesh_names, p.placements)
        assert mesh_names[: len(replicate)] == tuple(replicate)
        assert all(isinstance(q, Replicate) for q in p.placements[: len(replicate)])
        fsdp = p.placements[len(replicate) : -1]
        assert all(isinstance(q, (Shard, _StridedShard)) and q.dim == 0 for q in fsdp)
        assert "ep" not in mesh_names[:-1]
        # per-rank expert bytes: total / (ep x the remaining dp shard)
        assert p._local_tensor.numel() * p.element_size() == p.numel() * p.element_size() // (moe["ep"] * shard)
    dense = model.get_parameter("layers.0.router.weight")
    assert isinstance(dense, DTensor) and "ep" not in (dense.device_mesh.mesh_dim_names or ())


def test_each_expert_module_is_handed_its_ep_mesh() -> None:
    model = _parallelize((4,), ("dp",), {"dp_shard": 2, "ep": 2})
    for layer in model.layers:  # type: ignore[union-attr]
        ep = layer.experts.ep_mesh
        assert isinstance(ep, DeviceMesh) and ep.mesh_dim_names == ("ep",) and ep.size() == 2
        assert isinstance(layer.experts, FSDPModule)


def test_the_plan_shows_the_experts_ep_placement() -> None:
    with fake_mesh((4,), ("dp",)) as mesh:
        moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        plan = FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh).plan(build())
    assert plan.expert_parallel == fsdptx.ExpertParallel(
        modules=("layers.0.experts", "layers.1.experts"), num_experts=(EXPERTS, EXPERTS), params=EXPERT_PARAMS
    )
    text = str(plan)
    assert f"expert parallel: 2 expert modules ({EXPERTS} experts each), 4 params Shard(0)" in text
    assert "layers.{0..1}.experts  Shard(0) on ep" in text
    assert fsdptx.plan_from_json(fsdptx.plan_to_json(plan)) == plan


def test_without_ep_the_manager_plans_no_expert_parallelism() -> None:
    with fake_mesh((4,), ("dp",)) as mesh:
        moe_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep_shard",))
        plan = FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh).plan(build())
    assert plan.expert_parallel is None and "expert parallel" not in str(plan)


# ------------------------------------------------------ refused before mutation


def _untouched(model: nn.Module) -> bool:
    return not any(isinstance(p, DTensor) for p in model.parameters()) and not any(
        isinstance(m, FSDPModule) for m in model.modules()
    )


class _Hookless(nn.Module):
    """Stacked experts with no way to learn the ep group."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, 4, 4))


def _hookless_model() -> TinyMoE:
    model = build()
    for layer in model.layers:
        layer.experts = _Hookless()  # type: ignore[assignment]
    return model


@pytest.mark.parametrize(
    ("shape", "moe", "model", "match"),
    [
        ((6,), {"dp_shard": 2, "ep": 3}, build, r"'layers\.0\.experts \(4 experts\)'.*cannot be split evenly across ep=3"),
        ((4,), {"dp_shard": 2, "experts": 2}, build, r"moe_mesh has dim\(s\) \['experts'\].*name each dim one of"),
        ((4,), {"dp_shard": 1, "ep": 2}, build, r"moe_mesh spans 2 ranks .* but device_mesh spans 4"),
        ((4,), {"dp_shard": 2, "ep": 2}, _hookless_model, r"'layers\.0\.experts'.*define no set_expert_parallel_mesh"),
    ],
    ids=["experts-not-divisible", "unknown-dim", "other-world", "no-dispatch-hook"],
)
def test_bad_meshes_and_models_are_refused_before_mutation(
    shape: tuple[int, ...], moe: dict[str, int], model: Any, match: str
) -> None:
    m = model()
    world = math.prod(shape)
    with fake_mesh(shape, ("dp",)) as mesh:
        if math.prod(moe.values()) != world:
            moe_mesh = DeviceMesh("cpu", torch.arange(math.prod(moe.values())).reshape(tuple(moe.values())), mesh_dim_names=tuple(moe))
        else:
            moe_mesh = init_device_mesh("cpu", tuple(moe.values()), mesh_dim_names=tuple(moe))
        with pytest.raises((ValueError, fsdptx.PlanningError), match=match):
            manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh)
            manager.parallelize(m)
    assert _untouched(m)


def test_apply_plan_refuses_an_ep_mesh_the_plan_does_not_split_experts_across() -> None:
    model = build()
    plan = fsdptx.plan(model, fsdptx.shard_by_dtype)  # expert units, no expert_parallel
    with fake_mesh((4,), ("dp",)) as mesh:
        moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        with pytest.raises(fsdptx.PlanMismatchError, match=r"has ep=2, but the plan does not split experts.*fsdptx\.expert_parallel"):
            fsdptx.apply_plan(plan, model, mesh, moe_mesh=moe_mesh)
    assert _untouched(model)


def test_apply_plan_refuses_expert_parallelism_without_an_ep_dim() -> None:
    model = build()
    plan = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.expert_parallel))
    with fake_mesh((4,), ("dp",)) as mesh:
        moe_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep_shard",))
        with pytest.raises(fsdptx.PlanMismatchError, match=r"splits experts 'layers\.0\.experts'.*has no ep dim of size > 1"):
            fsdptx.apply_plan(plan, model, mesh, moe_mesh=moe_mesh)
    assert _untouched(model)


def test_planning_refuses_expert_modules_whose_parameters_disagree_on_the_expert_count() -> None:
    model = build()
    model.layers[0].experts.extra = nn.Parameter(torch.zeros(3))  # type: ignore[union-attr]
    with pytest.raises(fsdptx.PlanningError, match=r"'layers\.0\.experts'.*layers\.0\.experts\.extra: 3"):
        fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.expert_parallel))


def test_planning_warns_about_expert_modules_without_the_dispatch_hook() -> None:
    plan = fsdptx.plan(_hookless_model(), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.expert_parallel))
    assert any("define no set_expert_parallel_mesh" in w for w in plan.warnings)
    assert "warning: expert modules 'layers.0.experts', 'layers.1.experts'" in str(plan)


# ------------------------------------------------------------- TP-replica rules


def test_ep_sharded_experts_are_not_tp_replicas_and_the_sync_leaves_them_alone() -> None:
    """Dense mesh ``dp=2 x tp=2`` and MoE mesh ``dp_shard=2 x ep=2`` over the
    same ranks: the ep groups are the tp groups, so TP peers hold different
    experts. ``is_tp_replicated`` says so from the placements alone (the
    plan's expert exclusion aside), and the sync counts only dense params."""
    model = build()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan={"head": "colwise"}), mesh, moe_mesh=moe_mesh).parallelize(model)
        tp_ranks = mesh["tp"].mesh.tolist()
        replicated = {n for n, p in model.named_parameters() if fsdptx.is_tp_replicated(p, tp_ranks, 0, "tp")}
        assert replicated.isdisjoint(EXPERT_PARAMS)
        assert replicated == {n for n in dict(model.named_parameters()) if n not in EXPERT_PARAMS and n != "head.weight"}
        # the audit compares the same tensors along tp
        assert dict(fsdptx.audit_replicas([model], mesh).checked)["tp"] == len(replicated)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        assert fsdptx.synchronize_tp_replica_gradients([model], mesh) == len(replicated) == 7


def test_the_dp_audit_skips_experts_that_dense_replicas_hold_different_shares_of() -> None:
    """Dense ``dp_replicate=2 x dp_shard=2`` (replica peers 0 and 2) and MoE
    ``ep=2 x dp_replicate=2`` (ep outer: ranks 0 and 2 hold different
    experts): the audit along the dense ``dp_replicate`` leaves the experts
    out, by their placements, and compares every dense parameter."""
    model = build()
    with fake_mesh((2, 2), ("dp_replicate", "dp_shard")) as mesh:
        moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp_replicate"))
        FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh).parallelize(model)
        checked = dict(fsdptx.audit_replicas([model], mesh).checked)
    assert checked["dp_replicate"] == sum(1 for n, _ in model.named_parameters() if n not in EXPERT_PARAMS)


def test_experts_replicated_across_tp_peers_are_tp_replicas() -> None:
    """MoE mesh ``dp_replicate=2 x ep=2`` where the TP peers lie along
    ``dp_replicate``: each TP peer holds the same experts, so they are TP
    replicas by placement (the plan still excludes expert modules from the
    sync: FSDP's replicate all-reduce already averages them)."""
    model = build()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe_mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T, mesh_dim_names=("dp_replicate", "ep"))
        FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan={"head": "colwise"}), mesh, moe_mesh=moe_mesh).parallelize(model)
        tp_ranks = mesh["tp"].mesh.tolist()
        assert all(fsdptx.is_tp_replicated(model.get_parameter(n), tp_ranks, 0, "tp") for n in EXPERT_PARAMS)
