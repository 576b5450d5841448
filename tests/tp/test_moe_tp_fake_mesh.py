"""Hugging Face MoE models under tensor parallelism on fake meshes (one
process): how the experts are split, what an fp32 router is fed, and which
expert plans are refused before the model is touched.

Collectives on a fake process group do not communicate, so values are
meaningless here; layouts, dtypes and per-rank sizes are not. Parity with
one process is in ``test_moe_tp_gloo.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx import FSDP2Config, FSDP2Manager, PlanningError  # noqa: E402
from fsdptx.testing import fake_mesh  # noqa: E402

import hf_zoo  # noqa: E402
from unchanged import assert_unchanged, state_of  # noqa: E402

ROUTER = "mlp.gate."  # Mixtral's, Qwen2-MoE's and OLMoE's router: mlp.gate.weight


def _expert_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".mlp.experts." in n}


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _expert_bytes_per_rank(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, int]:
    with fake_mesh(shape, names) as mesh:
        model = hf_zoo.deepseek_v3("cpu", torch.float32)
        FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(model)
        return {n: _local_bytes(p) for n, p in _expert_weights(model).items()}


# ------------------------------------------------------------ experts split over tp


def test_deepseek_v3_expert_weights_are_dtensors_split_over_tp_per_half_of_gate_up() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = hf_zoo.deepseek_v3("cpu", torch.float32)
        FSDP2Manager(FSDP2Config(mp_policy=None), mesh).parallelize(model)
        experts = _expert_weights(model)
        assert experts, "the tiny DeepSeek-V3 has an MoE layer"
        for name, p in experts.items():
            assert isinstance(p, DTensor), name
            tp = dict(zip(p.device_mesh.mesh_dim_names or (), p.placements))["tp"]
            if name.endswith("gate_up_proj"):
                assert tp == _StridedShard(1, split_factor=2), name
            else:
                assert tp == Shard(2), name


def test_deepseek_v3_expert_bytes_per_rank_halve_from_tp_1_to_tp_2() -> None:
    tp1 = _expert_bytes_per_rank((2,), ("dp",))
    tp2 = _expert_bytes_per_rank((2, 2), ("dp", "tp"))
    assert tp1.keys() == tp2.keys()
    assert {n: 2 * b for n, b in tp2.items()} == tp1


def test_declared_expert_entries_become_one_experts_style_per_moe_layer() -> None:
    model = hf_zoo.qwen3_moe("meta", torch.float32)
    tp = fsdptx.plan(model, fsdptx.tensor_parallel).tensor_parallel
    assert tp is not None
    styles = {a.module: a.style for a in tp.assignments if a.module.endswith(".experts")}
    assert styles == {
        f"model.layers.{i}.mlp.experts": "moe_tp_experts(gate_up_proj: packed_colwise, down_proj: rowwise)"
        for i in range(hf_zoo.LAYERS)
    }
    assert not [s for s in tp.skipped if "experts" in s[0]]


# ------------------------------------------------------------------ fp32 routers


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_an_fp32_router_in_a_bf16_model_computes_in_fp32_and_the_block_stays_bf16(name: str) -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = getattr(hf_zoo, name)("cpu", torch.bfloat16, keep_in_fp32=(ROUTER,))
        FSDP2Manager(FSDP2Config(), mesh).parallelize(model)
        layer = model.model.layers[0]
        router_inputs: list[torch.dtype] = []
        block_outputs: list[torch.dtype] = []
        layer.mlp.gate.register_forward_hook(lambda m, args, out: router_inputs.append(args[0].dtype))
        layer.register_forward_hook(lambda m, args, out: block_outputs.append(out.dtype))
        logits = model(input_ids=torch.randint(0, hf_zoo.VOCAB, (2, 8))).logits
        logits.float().sum().backward()
        weight = layer.mlp.gate.weight
        assert weight.dtype == torch.float32
        assert weight.grad is not None and weight.grad.dtype == torch.float32
        assert router_inputs == [torch.float32]
        assert block_outputs == [torch.bfloat16]
        assert logits.dtype == torch.bfloat16


def test_a_module_only_partly_fp32_is_not_fed_fp32_inputs() -> None:
    """GPT-OSS's attention holds fp32 sinks beside bf16 projections: casting
    its inputs would run the projections on fp32 activations."""
    with fake_mesh((2,), ("dp",)) as mesh:
        model = hf_zoo.gpt_oss("cpu", torch.bfloat16)
        FSDP2Manager(FSDP2Config(), mesh).parallelize(model)
        seen: list[torch.dtype] = []
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
        model(input_ids=torch.randint(0, hf_zoo.VOCAB, (2, 8)))
        assert seen == [torch.bfloat16]


# ------------------------------------------------- refused before any mutation

_EXPERTS = "model.layers.*.mlp.experts"


def _explicit(**entries: str) -> dict[str, Any]:
    return {_EXPERTS: "moe_tp_experts", **{f"{_EXPERTS}.{k}": v for k, v in entries.items()}}


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"gate_up_proj": "packed_colwise"}, r"holds 'down_proj', which the plan does not split"),
        ({"gate_up_proj": "packed_colwise", "down_proj": "embedding_rowwise"}, r"down_proj \(3-D\) gets 'embedding_rowwise'"),
        ({"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "w3": "colwise"}, r"has no parameter 'w3'"),
    ],
    ids=["a-weight-left-whole", "a-style-that-cannot-split-an-expert-weight", "a-parameter-that-does-not-exist"],
)
def test_an_explicit_experts_plan_that_cannot_split_every_weight_is_refused_naming_it(
    entries: dict[str, str], message: str
) -> None:
    model = hf_zoo.qwen3_moe("cpu", torch.float32)
    before = state_of(model)
    with pytest.raises(PlanningError, match=message) as info:
        fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, plan=_explicit(**entries)))
    assert "model.layers.0.mlp.experts" in str(info.value)
    assert_unchanged(before, state_of(model))


def test_a_declared_experts_plan_that_cannot_split_every_weight_leaves_them_whole_and_says_so_first() -> None:
    model = hf_zoo.qwen3_moe("meta", torch.float32)
    model._tp_plan = {k: v for k, v in model._tp_plan.items() if not k.endswith("experts.down_proj")}
    p = fsdptx.plan(model, fsdptx.tensor_parallel)
    assert p.tensor_parallel is not None
    assert not [a for a in p.tensor_parallel.assignments if a.module.endswith(".experts")]
    first = str(p).splitlines()[0]
    assert first.startswith("warning: tensor_parallel: the declared TP plan's experts 'model.layers.*.mlp.experts'")
    assert "'down_proj'" in first


def test_expert_weights_whose_half_tp_does_not_divide_are_refused_before_any_change() -> None:
    with fake_mesh((3,), ("tp",)) as mesh:
        model = hf_zoo.qwen3_moe("cpu", torch.float32)  # moe_intermediate_size 32: not divisible by 3
        p = fsdptx.plan(model, fsdptx.tensor_parallel)
        before = state_of(model)
        with pytest.raises(ValueError, match=r"experts\.gate_up_proj: half of dim 1 \(packed gate\|up\)=32 is not divisible by tp=3"):
            fsdptx.apply_plan(p, model, mesh)
        assert_unchanged(before, state_of(model))


class _BareExperts(nn.Module):
    """Grouped experts without a router beside them: a block child of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(2, 16, 8))
        self.down_proj = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("bsd,eod->bseo", x, self.gate_up_proj).chunk(2, dim=-1)
        return x + torch.einsum("bsei,edi->bsd", torch.relu(gate) * up, self.down_proj)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.experts = _BareExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(self.norm(x))


class _BareExpertsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.lm_head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


def test_experts_split_over_tp_on_the_sequence_shard_are_refused_at_planning() -> None:
    plan = {
        "layers.*.experts": "moe_tp_experts",
        "layers.*.experts.gate_up_proj": "packed_colwise",
        "layers.*.experts.down_proj": "rowwise",
    }
    model = _BareExpertsModel()
    tp = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, plan=plan)).tensor_parallel
    assert tp is not None and [a.module for a in tp.assignments] == ["layers.0.experts", "layers.1.experts"]
    sp = functools.partial(fsdptx.tensor_parallel, plan=plan, sequence_parallel=True, blocks=["layers.*"])
    with pytest.raises(PlanningError, match=r"'layers\.0\.experts' \(moe_tp_experts\) sits on the residual stream"):
        fsdptx.plan(model, sp)


def test_experts_that_shard_over_a_moe_mesh_stay_whole_on_every_tp_rank() -> None:
    """FSDP cannot lay an expert unit over the MoE mesh on top of a TP
    DTensor of the dense mesh; such experts keep the layout they had."""
    from torch.distributed.device_mesh import DeviceMesh

    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        moe = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("ep_shard",))
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe)
        model = hf_zoo.qwen3_moe("cpu", torch.float32)
        tp = manager.plan(model).tensor_parallel
        assert tp is not None
        assert (_EXPERTS, "moe_tp_experts", "shards over the moe_mesh: left whole on every TP rank") in tp.skipped
        manager.parallelize(model)
        for name, p in _expert_weights(model).items():
            assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("ep_shard",), name
