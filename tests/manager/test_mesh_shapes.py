"""What ``FSDP2Manager`` does on each shape of mesh: one data-parallel rank
(a world of one, a ``tp``-only mesh), a replicate-only mesh, and a MoE mesh
that the dry run must refuse exactly where ``parallelize`` would.

On one data-parallel rank FSDP shards nothing; fsdptx still plans units
when a mixed-precision or offload policy is set (FSDP is what applies it)
and says so in the Plan, where the reference skips FSDP on a world of one
(docs/manager.md, Meshes).
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.apply._checkpoint import is_checkpointed
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of

BF16 = torch.bfloat16


def small() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


def _sharded(model: nn.Module) -> list[str]:
    return [f for f, m in model.named_modules() if isinstance(m, FSDPModule)]


# ---------------------------------------------------------- one data-parallel rank


def test_a_world_of_one_keeps_the_policy_in_units_and_the_plan_says_they_shard_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = small()
    with fake_mesh((1,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(activation_checkpointing=True), mesh)
        p = manager.plan(model)
        with caplog.at_level(logging.WARNING, logger="fsdptx.manager"):
            manager.parallelize(model)
    assert [u.modules for u in p.units] == [("layers.0",), ("layers.1",), ("",)]
    assert {u.compute_dtype for u in p.units} == {BF16}
    (note,) = [w for w in p.warnings if "world of one rank" in w]
    assert "shard nothing" in note and "FSDP2Config(mp_policy=None, offload_policy=None)" in note
    assert str(p).startswith(f"warning: {note}")
    assert note in caplog.text
    assert _sharded(model) == ["", "layers.0", "layers.1"]
    assert all(is_checkpointed(b) for b in model.layers)


def test_a_world_of_one_without_policies_plans_no_units_and_still_checkpoints() -> None:
    model = small()
    with fake_mesh((1,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None, activation_checkpointing=True), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
    assert p.units == () and p.warnings == ()
    assert p.checkpointing is not None and p.checkpointing.modules == ("layers.0", "layers.1")
    assert _sharded(model) == []
    assert all(is_checkpointed(b) for b in model.layers)
    assert not any(isinstance(q, DTensor) for q in model.parameters())


def test_a_tp_only_mesh_applies_tp_and_units_that_only_apply_the_policy() -> None:
    model = small()
    with fake_mesh((2,), ("tp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
        q_proj = model.layers[0].attn.q_proj.weight
        assert isinstance(q_proj, DTensor) and Shard(0) in q_proj.placements
        assert q_proj.to_local().shape[0] == q_proj.shape[0] // 2  # TP halves it; FSDP over 1 rank keeps the rest
    assert p.tensor_parallel is not None and p.tensor_parallel.assignments
    assert [u.modules for u in p.units] == [("layers.0",), ("layers.1",), ("",)]
    assert any(w.startswith("one data-parallel rank: the FSDP units shard nothing") for w in p.warnings)
    assert _sharded(model) == ["", "layers.0", "layers.1"]


def test_a_tp_only_mesh_without_policies_applies_tp_and_no_units() -> None:
    model = small()
    with fake_mesh((2,), ("tp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
        assert isinstance(model.layers[0].attn.q_proj.weight, DTensor)
    assert p.units == () and p.warnings == ()
    assert _sharded(model) == []


def test_several_data_parallel_ranks_plan_units_without_the_one_rank_note() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        p = FSDP2Manager(FSDP2Config(), mesh).plan(small())
    assert p.units and not any("shard nothing" in w for w in p.warnings)


# ---------------------------------------------------------- replicate-only meshes


@pytest.mark.parametrize(("shape", "names"), [((2,), ("dp_replicate",)), ((2, 2), ("dp_replicate", "tp"))])
def test_dp_replicate_alone_replicates_whole_parameters_with_a_shard_dim_of_one(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    model = small()
    with fake_mesh(shape, names) as mesh:
        FSDP2Manager(FSDP2Config(), mesh).parallelize(model)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            fsdp = dict(zip(param.device_mesh.mesh_dim_names or (), param.placements))
            assert fsdp["dp_replicate"] == Replicate() and param.device_mesh["dp_shard"].size() == 1, name
            tp_split = "tp" in fsdp and fsdp["tp"] != Replicate()
            if not tp_split:
                assert param.to_local().shape == param.shape, name


# ---------------------------------------------------------- the MoE mesh, refused by the dry run


def _moe_mesh(kind: str, mesh: DeviceMesh) -> object:
    ranks = torch.arange(4)
    if kind == "not a mesh":
        return "moe"
    if kind == "another world":
        return DeviceMesh("cpu", ranks[:2], mesh_dim_names=("ep_shard",))
    if kind == "no data-parallel dim":
        return DeviceMesh("cpu", ranks.reshape(2, 2), mesh_dim_names=("ep", "tp"))
    assert kind == "unknown dim"
    return DeviceMesh("cpu", ranks.reshape(2, 2), mesh_dim_names=("experts", "ep_shard"))


_REFUSALS = {
    "not a mesh": (TypeError, "moe_mesh must be a torch DeviceMesh, got str"),
    "another world": (ValueError, "moe_mesh spans 2 ranks .* but device_mesh spans 4"),
    "no data-parallel dim": (ValueError, "moe_mesh .* has no data-parallel dim"),
    "unknown dim": (ValueError, r"moe_mesh has dim\(s\) \['experts'\] fsdptx does not know"),
}


@pytest.mark.parametrize("kind", list(_REFUSALS))
def test_the_dry_run_refuses_the_moe_mesh_parallelize_refuses(kind: str) -> None:
    error, match = _REFUSALS[kind]
    model = small()
    before = state_of(model)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe = _moe_mesh(kind, mesh)
        with pytest.raises(error, match=match):
            FSDP2Manager(FSDP2Config(), mesh, moe_mesh=moe).plan(model)  # type: ignore[arg-type]
        with pytest.raises(error, match=match):
            FSDP2Manager(FSDP2Config(), mesh, moe_mesh=moe).parallelize(model)  # type: ignore[arg-type]
    assert_unchanged(before, state_of(model))


# ---------------------------------------------------------- experts and the TP-replica sync


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsd,edf->bsf", x, self.w)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.proj(x))


class _MoE(nn.Module):
    _no_split_modules = ["_MoEBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_MoEBlock() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def test_experts_sharded_over_the_moe_meshs_data_parallel_dims_are_left_out_of_the_tp_replica_sync() -> None:
    model = _MoE()
    config = FSDP2Config(mp_policy=None, expert_modules=("layers.*.experts",))
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe = DeviceMesh("cpu", torch.arange(4).reshape(1, 4), mesh_dim_names=("ep", "ep_shard"))
        p = FSDP2Manager(config, mesh, moe_mesh=moe).plan(model)
        assert {"layers.0.experts", "layers.1.experts"} <= set(p.exclusions)
        FSDP2Manager(config, mesh, moe_mesh=moe).parallelize(model)
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)
        experts = {f: q for f, q in model.named_parameters() if ".experts." in f}
        dense = {f: q for f, q in model.named_parameters() if ".experts." not in f}
        assert synced == len(dense)
        # A fake group's all-reduce returns this rank's gradient: a synced
        # ("mean") one is halved, one left out keeps its value.
        for f, q in experts.items():
            assert q.grad is not None and bool((q.grad.to_local() == 1).all()), f
        for f, q in dense.items():
            assert q.grad is not None and bool((q.grad.to_local() == 0.5).all()), f
