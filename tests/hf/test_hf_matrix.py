"""Real Hugging Face architectures, as shipped, plan and apply with the
manager's defaults on fake meshes (dp=8, and dp=2 x tp=2 with Hugging Face's
own TP plan): every parameter owned by exactly one unit and a DTensor after
apply, every fp32 holder computing in fp32, blocks as units, a tied
embedding named by its owner, and the same plan with caches off. Kimi-Linear,
whose ``forget_gate`` holds fp32 and bf16 parameters directly, is refused
with an error that says why.

Models are built tiny on the meta device from their config classes
(``tests/support/hf_zoo.py``); nothing is downloaded.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import hf_zoo  # noqa: E402

import fsdptx  # noqa: E402
from fsdptx.model._index import ModelIndex  # noqa: E402
from fsdptx.testing import fake_mesh  # noqa: E402

PLANNABLE = sorted(n for n in hf_zoo.ZOO if n != "kimi_linear")
MESHES = {"dp8": ((8,), ("dp",)), "dp2_tp2": ((2, 2), ("dp", "tp"))}
TIED_OWNERS = {
    "qwen3_tied": "model.embed_tokens.weight",
    "gemma3_multimodal": "model.language_model.embed_tokens.weight",
}


def _applied(name: str, mesh_name: str) -> Iterator[tuple[nn.Module, fsdptx.Plan]]:
    model = hf_zoo.ZOO[name]("meta")
    shape, names = MESHES[mesh_name]
    with fake_mesh(shape, names) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
        yield model, p


@pytest.fixture(params=[(n, m) for n in PLANNABLE for m in MESHES], ids=lambda nm: f"{nm[0]}-{nm[1]}")
def applied(request: pytest.FixtureRequest) -> Iterator[tuple[str, nn.Module, fsdptx.Plan]]:
    name, mesh_name = request.param
    for model, p in _applied(name, mesh_name):
        yield name, model, p


def test_every_parameter_is_owned_by_exactly_one_unit(applied: tuple[str, nn.Module, fsdptx.Plan]) -> None:
    _name, model, p = applied
    owned = [f for u in p.units for f in u.params]
    assert len(owned) == len(set(owned))
    assert len(owned) == len(list(model.parameters()))


def test_every_parameter_is_a_dtensor_after_apply(applied: tuple[str, nn.Module, fsdptx.Plan]) -> None:
    _name, model, _p = applied
    plain = [n for n, q in model.named_parameters() if not isinstance(q, DTensor)]
    assert plain == []


def test_every_fp32_holder_computes_in_fp32(applied: tuple[str, nn.Module, fsdptx.Plan]) -> None:
    """The bulk is bf16; what the model keeps in fp32 (sinks, A_log, D,
    dt_bias, routers) must not be cast down by its unit's policy."""
    _name, _model, p = applied
    for u in p.units:
        if u.storage_dtype == torch.float32:
            assert u.compute_dtype == torch.float32, u.modules
            assert u.mp_policy is not None and u.mp_policy.param_dtype == torch.float32, u.modules


def test_every_block_is_a_unit(applied: tuple[str, nn.Module, fsdptx.Plan]) -> None:
    name, model, p = applied
    blocks = ModelIndex.build(model).blocks
    assert blocks, name
    heads = {u.modules[0] for u in p.units if u.kind == "block"}
    assert set(blocks) <= heads


@pytest.mark.parametrize("name", sorted(TIED_OWNERS))
def test_tied_embedding_is_named_by_its_owner(name: str) -> None:
    for _model, p in _applied(name, "dp2_tp2"):
        owned = p.owned_params
        assert TIED_OWNERS[name] in owned
        assert "lm_head.weight" not in owned


def test_tp_plan_of_hugging_face_is_applied_on_the_tp_dim() -> None:
    for model, p in _applied("llama", "dp2_tp2"):
        assert p.tensor_parallel is not None and p.tensor_parallel.assignments
        q = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(q, DTensor) and q.device_mesh.mesh_dim_names == ("dp", "tp")


def test_kimi_linear_as_shipped_is_refused_naming_the_module_to_split() -> None:
    model = hf_zoo.ZOO["kimi_linear"]("meta")
    with fake_mesh((8,), ("dp",)) as mesh, pytest.raises(fsdptx.PlanningError) as info:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh).plan(model)
    message = str(info.value)
    assert "forget_gate" in message and "dt_bias" in message and "split the module" in message.lower()
    assert "ignored_params" not in message


def test_gpt_oss_sinks_of_all_blocks_become_one_unit_with_cross_block_modules() -> None:
    """The sinks sit directly on ``self_attn`` beside bf16 projections;
    naming ``self_attn`` puts every block's sinks in one fp32 FSDP unit (one
    reduce-scatter per step instead of one per block), after the
    projections got theirs."""
    model = hf_zoo.ZOO["gpt_oss"]("meta")
    with fake_mesh((8,), ("dp",)) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(cross_block_modules=("self_attn",)), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
    (unit,) = [u for u in p.units if u.kind == "cross-block"]
    assert unit.params == ("model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks")
    assert unit.compute_dtype == torch.float32 and unit.reshard_after_forward is False
    state = fsdptx_state(model.model.layers[0].self_attn)
    assert state is fsdptx_state(model.model.layers[1].self_attn)


def fsdptx_state(module: nn.Module) -> object:
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]


def test_sequence_parallelism_leaves_a_stack_without_tp_alone() -> None:
    """Gemma3's vision tower is not in the TP plan: its norms must not be
    put on a sequence shard; the language model's blocks are."""
    model = hf_zoo.ZOO["gemma3_multimodal"]("meta")
    p = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))
    assert p.tensor_parallel is not None
    modules = [a.module for a in p.tensor_parallel.assignments]
    assert not [m for m in modules if m.startswith("model.vision_tower")]
    assert "model.language_model.layers.0" in modules
    assert "model.language_model.layers.0.input_layernorm" in modules


def test_moe_experts_left_whole_by_the_tp_plan_run_on_the_whole_sequence_under_sequence_parallelism() -> None:
    """Qwen3-MoE's experts stay whole on every TP rank (``moe_tp_experts``
    has no torch style). Under SP their MoE block is handed the whole
    sequence and slices its output back, so every TP rank computes the same
    expert gradients: no TP ``sum`` is needed for them, and the expert
    exclusion (a ``moe_mesh``) costs nothing. They used to see only their
    rank's tokens, which needed a sum the exclusion skipped."""
    from torch.distributed.device_mesh import DeviceMesh

    model = hf_zoo.ZOO["qwen3_moe"]("meta")
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("ep_shard", "tp"))
        p = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True), mesh, moe_mesh=moe).plan(model)
    assert p.tensor_parallel is not None
    styles = {a.module: a.style for a in p.tensor_parallel.assignments}
    assert styles["model.layers.0.mlp"] == "whole_sequence (sp)"
    assert styles["model.layers.0.self_attn"] == "gather_sequence (sp)"
    assert "model.layers.0.mlp.experts" in p.exclusions
    assert not [k for k in p.reductions if ".mlp." in k]


def _same_plan_with_caches_off(model: nn.Module) -> None:
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fast = fsdptx.plan(model, pipeline, mp_policy=policy)
    with fsdptx.caches(enabled=False):
        plain = fsdptx.plan(model, pipeline, mp_policy=policy)
    assert fast.units and fast == plain


@pytest.mark.parametrize("name", PLANNABLE)
def test_planning_with_caches_off_gives_the_same_plan(name: str) -> None:
    """Block replay and the other fast paths are optional layers: on a real
    architecture the plain planner (caches off) gives the very same plan."""
    _same_plan_with_caches_off(hf_zoo.ZOO[name]("meta"))


def test_a_run_of_blocks_broken_by_an_fp32_mlp_plans_as_with_caches_off() -> None:
    """Six GPT-OSS blocks built alike but for the fourth, whose MLP is kept
    in fp32: replaying the run must not carry the first block's units over
    it (its MLP becomes a unit of its own)."""
    model = hf_zoo.gpt_oss("meta", layers=6)
    model.model.layers[3].mlp.float()
    _same_plan_with_caches_off(model)
