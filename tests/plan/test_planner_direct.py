"""Parameters held directly by a module beside children of another dtype.

Real models keep intrinsically-fp32 parameters directly on a module whose
children are bf16: GPT-OSS ``self_attn.sinks``, Mamba2/NemotronH
``mixer.A_log``/``D``/``dt_bias``. These tests specify how such modules are
planned (children first, then a unit owning only the direct parameters), how
frozen parameters, cross-block names, tied weights and ignored parameters
interact with that, and check each plan with real ``fully_shard`` on a fake
mesh.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
from models import BF16, DIM, FP32, CastLinear, make_decoder, master_weights
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx import Plan, PlanningError, Unit
from fsdptx.plan.resolve import _replay, resolve_units
from fsdptx.model._index import ModelIndex
from fsdptx.testing import fake_mesh, mark_sharded

POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
PARTS = (fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)


# --------------------------------------------------------------------------- models


class SinkAttention(nn.Module):
    """GPT-OSS style: bf16 projections and an fp32 ``sinks`` held directly."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = CastLinear(DIM, DIM, BF16)
        self.k_proj = CastLinear(DIM, DIM, BF16)
        self.v_proj = CastLinear(DIM, DIM, BF16)
        self.o_proj = CastLinear(DIM, DIM, BF16)
        self.sinks = nn.Parameter(torch.full((DIM,), 0.5, dtype=FP32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q_proj(x).float() * self.k_proj(x).float() + self.v_proj(x).float() + self.sinks
        return self.o_proj(h)


class Mixer(nn.Module):
    """Mamba2 style: fp32 ``A_log``, ``D`` and ``dt_bias`` held directly,
    recorded fp32 at load (``_hf_compute_dtype``), beside bf16 projections."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = CastLinear(DIM, DIM, BF16)
        self.out_proj = CastLinear(DIM, DIM, BF16)
        for name in ("A_log", "D", "dt_bias"):
            p = nn.Parameter(torch.ones(DIM, dtype=FP32))
            p._hf_compute_dtype = FP32  # type: ignore[attr-defined]
            self.register_parameter(name, p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x).float() * torch.exp(self.A_log) + self.D + self.dt_bias
        return self.out_proj(h)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = SinkAttention()
        self.up = CastLinear(DIM, DIM, BF16)
        self.norm = nn.LayerNorm(DIM, dtype=BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.up(self.self_attn(x)).to(BF16))


class SinkModel(nn.Module):
    """A tiny GPT-OSS: blocks in ``layers``, sinks pinned fp32 by name."""

    _no_split_modules = ["Block"]
    _keep_in_fp32_modules_strict = ["sinks"]

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, DIM, dtype=BF16)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = CastLinear(DIM, 16, BF16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class CrossBlockSinkModel(SinkModel):
    """The same, asking for one cross-block unit for every block's sinks by
    naming the module that holds them directly."""

    _fsdp_shard_across_blocks = ["self_attn"]


def leaf(dtype: torch.dtype, n: int = 1) -> nn.Module:
    m = nn.Module()
    for i in range(n):
        m.register_parameter(f"w{i}", nn.Parameter(torch.zeros(2, dtype=dtype)))
    return m


def tree(**children: nn.Module) -> nn.Module:
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


# --------------------------------------------------------------------------- helpers


def units_of(p: Plan) -> list[tuple[str, ...]]:
    return [u.modules for u in p.units]


def unit_for(p: Plan, module: str) -> Unit:
    found = [u for u in p.units if module in u.modules]
    assert len(found) == 1, f"{module!r} is in {len(found)} units of\n{p}"
    return found[0]


def apply_on_fake_mesh(p: Plan, model: nn.Module) -> None:
    """Apply with real ``fully_shard``; then every parameter is in exactly one
    FSDP parameter group and is a DTensor."""
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(p, model, mesh)
        groups: dict[int, Any] = {}
        for m in model.modules():
            if isinstance(m, FSDPModule):
                group = fully_shard.state(m)._fsdp_param_group  # type: ignore[attr-defined]
                if group is not None:
                    groups[id(group)] = group
        owners: dict[int, int] = {}
        for gid, group in groups.items():
            for fp in group.fsdp_params:
                assert id(fp.sharded_param) not in owners
                owners[id(fp.sharded_param)] = gid
    for f, param in model.named_parameters():
        assert isinstance(param, DTensor), f
        assert id(param) in owners, f"{f} belongs to no FSDP group"


class RecordingPrimitive:
    """Stands in for ``fully_shard``: records ``(modules, kwargs)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module | list[nn.Module], dict[str, Any]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: Any) -> None:
        self.calls.append((modules, kwargs))


# --------------------------------------------------------------------------- direct-parameter units


def test_attention_holding_fp32_sinks_directly_is_sharded_after_its_projections() -> None:
    """The projections share one unit (one all-gather, one reduce-scatter),
    then the attention module owns its sinks."""
    p = fsdptx.plan(SinkModel(1), PIPELINE, mp_policy=POLICY)
    assert units_of(p) == [
        ("layers.0.self_attn.k_proj", "layers.0.self_attn.o_proj", "layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj"),
        ("layers.0.self_attn",),
        ("layers.0",),
        ("",),
    ]


def test_direct_parameter_unit_owns_only_the_direct_parameters() -> None:
    p = fsdptx.plan(SinkModel(1), PIPELINE, mp_policy=POLICY)
    attn = unit_for(p, "layers.0.self_attn")
    assert (attn.kind, attn.params) == ("dtype", ("layers.0.self_attn.sinks",))


def test_direct_parameter_unit_computes_in_fp32_with_an_internal_policy() -> None:
    p = fsdptx.plan(SinkModel(1), PIPELINE, mp_policy=POLICY)
    attn = unit_for(p, "layers.0.self_attn")
    assert attn.compute_dtype == FP32
    assert attn.mp_policy == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_block_keeps_the_majority_beside_a_direct_parameter_unit() -> None:
    p = fsdptx.plan(SinkModel(1), PIPELINE, mp_policy=POLICY)
    block = unit_for(p, "layers.0")
    assert block.params == ("layers.0.norm.bias", "layers.0.norm.weight", "layers.0.up.weight")
    assert block.compute_dtype == BF16


def test_direct_parameter_units_apply_with_real_fully_shard() -> None:
    model = SinkModel()
    apply_on_fake_mesh(fsdptx.plan(model, PIPELINE, mp_policy=POLICY), model)
    attn_state = fully_shard.state(model.layers[1].self_attn)  # type: ignore[attr-defined]
    assert attn_state._mp_policy.param_dtype == FP32


def test_direct_parameter_plan_runs_forward_and_backward_on_fake_mesh() -> None:
    model = SinkModel()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(fsdptx.plan(model, PIPELINE, mp_policy=POLICY), model, mesh)
        model(torch.arange(6).reshape(2, 3)).float().sum().backward()
    assert all(q.grad is not None for q in model.parameters())


def test_mixer_with_fp32_direct_params_in_a_three_group_block_gets_its_own_unit() -> None:
    # bf16 projections, fp32->fp32 mixer params, an fp32 master-weight gate
    # computing in bf16: three groups.
    block = tree(mixer=Mixer(), gate=master_weights(leaf(FP32, 2), "w0", "w1"))
    model = tree(layers=nn.ModuleList([block]))
    p = fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    assert units_of(p) == [
        ("layers.0.gate",),
        ("layers.0.mixer.in_proj", "layers.0.mixer.out_proj"),  # one unit: same group below the holder
        ("layers.0.mixer",),
        ("",),
    ]
    mixer = unit_for(p, "layers.0.mixer")
    assert mixer.params == ("layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_bias")
    assert mixer.compute_dtype == FP32
    apply_on_fake_mesh(p, model)


def test_target_holding_the_minority_directly_owns_only_it_after_all_children() -> None:
    block = tree(a=leaf(BF16, 3), b=leaf(BF16, 2))
    block.scale = nn.Parameter(torch.ones(2, dtype=FP32))
    model = tree(blk=block)
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert units_of(p) == [("blk.a", "blk.b"), ("blk",), ("",)]
    assert (unit_for(p, "blk").params, unit_for(p, "blk").storage_dtype) == (("blk.scale",), FP32)
    apply_on_fake_mesh(p, model)


def test_direct_parameter_units_nest_children_before_parents() -> None:
    inner = tree(leaf16=leaf(BF16), leaf32=leaf(FP32))
    inner.b = nn.Parameter(torch.zeros(2, dtype=BF16))
    outer = tree(inner=inner)
    outer.a = nn.Parameter(torch.zeros(2, dtype=FP32))
    model = tree(blk=tree(outer=outer, big=leaf(BF16, 10)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert units_of(p) == [
        ("blk.outer.inner.leaf16",),
        ("blk.outer.inner.leaf32",),
        ("blk.outer.inner",),
        ("blk.outer",),
        ("blk",),
        ("",),
    ]
    apply_on_fake_mesh(p, model)


def test_direct_parameter_units_are_planned_in_name_order_not_registration_order() -> None:
    def build(order: tuple[str, ...]) -> nn.Module:
        attn = tree(**{n: leaf(BF16) for n in order})
        attn.sinks = nn.Parameter(torch.zeros(2, dtype=FP32))
        return tree(blk=tree(attn=attn, mlp=leaf(BF16, 8)))

    transform = functools.partial(fsdptx.shard_by_dtype, blocks=["blk"])
    plans = [fsdptx.plan(build(order), transform) for order in itertools.permutations(("q", "k", "o"))]
    assert all(p == plans[0] for p in plans[1:])


def test_module_mixing_groups_directly_raises_naming_each_parameter_and_the_fix() -> None:
    gate = tree(proj=leaf(BF16, 4))  # Kimi-Linear forget_gate style
    gate.dt_bias = nn.Parameter(torch.zeros(2, dtype=FP32))
    gate.A_log = nn.Parameter(torch.zeros(2, dtype=BF16))
    model = tree(layers=nn.ModuleList([tree(forget_gate=gate)]))
    with pytest.raises(PlanningError) as info:
        fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    message = str(info.value)
    assert "layers.0.forget_gate.dt_bias (float32->float32)" in message  # intrinsic fp32 in a bf16-bulk model
    assert "layers.0.forget_gate.A_log (bfloat16->bfloat16)" in message
    assert "Split the module" in message and "ignored_params" not in message


# --------------------------------------------------------------------------- frozen parameters


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def test_frozen_bf16_param_beside_trainable_fp32_ones_joins_their_unit() -> None:
    holder = leaf(FP32, 2)
    holder.frozen_bf16 = frozen(torch.zeros(2, dtype=BF16))
    model = tree(blk=tree(holder=holder, rest=leaf(BF16, 4)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    unit = unit_for(p, "blk.holder")
    assert unit.params == ("blk.holder.frozen_bf16", "blk.holder.w0", "blk.holder.w1")
    assert unit.storage_dtype == FP32
    apply_on_fake_mesh(p, model)


def test_non_floating_param_beside_trainable_fp32_ones_joins_their_unit() -> None:
    holder = leaf(FP32, 2)
    holder.index = frozen(torch.zeros(2, dtype=torch.int64))
    model = tree(blk=tree(holder=holder, rest=leaf(BF16, 4)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_for(p, "blk.holder").params == ("blk.holder.index", "blk.holder.w0", "blk.holder.w1")
    apply_on_fake_mesh(p, model)


def test_frozen_param_does_not_add_a_dtype_group() -> None:
    block = leaf(BF16, 3)
    block.frozen_fp32 = frozen(torch.zeros(2, dtype=FP32))
    model = tree(blk=block)
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert units_of(p) == [("blk",), ("",)] and unit_for(p, "blk").storage_dtype == BF16


def test_frozen_fp32_holder_alone_in_its_subtree_still_computes_in_fp32() -> None:
    # A frozen base model (LoRA): pinned sinks must keep computing in fp32.
    model = SinkModel(1)
    model.requires_grad_(False)
    p = fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    assert unit_for(p, "layers.0.self_attn").compute_dtype == FP32
    apply_on_fake_mesh(p, model)


# --------------------------------------------------------------------------- cross-block units by path


def test_cross_block_name_of_a_direct_holder_makes_one_unit_of_the_direct_params() -> None:
    p = fsdptx.plan(CrossBlockSinkModel(), PIPELINE, mp_policy=POLICY)
    unit = unit_for(p, "layers.0.self_attn")
    assert (unit.kind, unit.modules) == ("cross-block", ("layers.0.self_attn", "layers.1.self_attn"))
    assert unit.params == ("layers.0.self_attn.sinks", "layers.1.self_attn.sinks")
    assert (unit.compute_dtype, unit.reshard_after_forward) == (FP32, False)


def test_cross_block_direct_holder_children_are_sharded_before_it_and_blocks_after() -> None:
    p = fsdptx.plan(CrossBlockSinkModel(), PIPELINE, mp_policy=POLICY)
    kinds = [(u.kind, u.modules[0]) for u in p.units]
    cross = kinds.index(("cross-block", "layers.0.self_attn"))
    assert {m for u in p.units[:cross] for m in u.modules} == {
        f"layers.{i}.self_attn.{n}_proj" for i in range(2) for n in ("q", "k", "v", "o")
    }
    assert kinds[cross + 1 :] == [("block", "layers.0"), ("block", "layers.1"), ("root", "")]


def test_cross_block_direct_holder_plan_applies_as_one_fsdp_group() -> None:
    model = CrossBlockSinkModel()
    apply_on_fake_mesh(fsdptx.plan(model, PIPELINE, mp_policy=POLICY), model)
    groups = {id(fully_shard.state(b.self_attn)._fsdp_param_group) for b in model.layers}  # type: ignore[attr-defined]
    assert len(groups) == 1


def test_cross_block_direct_holder_plan_does_not_depend_on_transform_order() -> None:
    model = CrossBlockSinkModel(3)
    plans = [fsdptx.plan(model, fsdptx.compose(*order), mp_policy=POLICY) for order in itertools.permutations(PARTS)]
    assert all(p == plans[0] for p in plans[1:])


def test_cross_block_name_whose_direct_params_are_not_fp32_raises_naming_them() -> None:
    model = CrossBlockSinkModel()
    for block in model.layers:
        block.self_attn.scale = nn.Parameter(torch.ones(DIM, dtype=BF16))
    with pytest.raises(PlanningError) as info:
        fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    message = str(info.value)
    assert "'self_attn'" in message and "layers.0.self_attn.scale is bfloat16" in message
    assert "q_proj" not in message


def test_imperative_across_blocks_shards_holder_children_first() -> None:
    blocks = [Block(), Block()]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(blocks, "self_attn", object(), POLICY, None, shard_module=prim)  # type: ignore[arg-type]
    *children, (last, kwargs) = prim.calls
    assert last == [b.self_attn for b in blocks] and kwargs["reshard_after_forward"] is False
    called = [m for ms, _ in children for m in (ms if isinstance(ms, list) else [ms])]
    assert {id(m) for m in called} == {
        id(getattr(b.self_attn, f"{n}_proj")) for b in blocks for n in ("q", "k", "v", "o")
    }


# --------------------------------------------------------------------------- tied weights


class DeclaredTie(nn.Module):
    """Head tied to the embedding, declared Hugging Face 5.x style; the head's
    name sorts first, the declared source is the embedding."""

    _tied_weights_keys = {"a_head.weight": "embed.weight"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 2, dtype=BF16)
        self.a_head = nn.Linear(2, 4, bias=False, dtype=BF16)
        self.a_head.weight = self.embed.weight


def test_tied_parameter_is_named_by_its_declared_source() -> None:
    p = fsdptx.plan(DeclaredTie(), fsdptx.shard_by_dtype)
    assert p.units[-1].params == ("embed.weight",)


def test_tied_parameter_declared_by_target_list_is_named_by_the_other_name() -> None:
    model = DeclaredTie()
    model._tied_weights_keys = ["a_head.weight"]  # type: ignore[assignment]
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert p.units[-1].params == ("embed.weight",)


def test_undeclared_tie_is_named_by_its_smallest_name() -> None:
    model = DeclaredTie()
    model._tied_weights_keys = None  # type: ignore[assignment]
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert p.units[-1].params == ("a_head.weight",)


def test_hugging_face_tied_lm_head_is_named_by_the_embedding() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    owned = {f for u in p.units for f in u.params}
    assert "model.embed_tokens.weight" in owned and "lm_head.weight" not in owned


# --------------------------------------------------------------------------- ignored parameters


def record_by_dtype(module: nn.Module, ignored: set[nn.Parameter], tokens: tuple[str, ...] = ()) -> RecordingPrimitive:
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(module, object(), POLICY, None, tokens, None, ignored, shard_module=prim)  # type: ignore[arg-type]
    return prim


def test_enclosing_unit_receives_ignored_params_of_nested_units() -> None:
    # three groups: bf16 mlp, fp32->fp32 sinks, fp32->bf16 gate
    block = tree(mlp=leaf(BF16, 2), sinks=leaf(FP32), gate=leaf(FP32))
    ignored = {block.mlp.w0}
    prim = record_by_dtype(block, ignored, ("sinks",))
    calls = {id(m): kw for m, kw in prim.calls}
    assert calls[id(block.mlp)]["ignored_params"] == ignored
    assert calls[id(block)]["ignored_params"] == ignored


def test_module_whose_params_are_all_ignored_gets_a_unit_carrying_them() -> None:
    mlp = leaf(BF16, 2)
    ignored = {mlp.w0, mlp.w1}
    prim = record_by_dtype(mlp, ignored)
    assert [(m, kw["ignored_params"]) for m, kw in prim.calls] == [(mlp, ignored)]


def test_direct_parameter_unit_receives_ignored_params_below_it() -> None:
    model = SinkModel(1)
    transform = functools.partial(fsdptx.shard_by_dtype, ignored_params=["layers.0.self_attn.q_proj.weight"])
    p = fsdptx.plan(model, transform, mp_policy=POLICY)
    assert unit_for(p, "layers.0.self_attn").ignored_params == ("layers.0.self_attn.q_proj.weight",)


# --------------------------------------------------------------------------- strings where names are expected


def test_fp32_compute_module_names_as_one_string_is_one_name() -> None:
    # Read as characters, "sinks" would pin "linear" too (it contains "i", "n").
    block = tree(sinks=leaf(FP32), linear=leaf(FP32, 3))
    prim = record_by_dtype(block, set(), "sinks")  # type: ignore[arg-type]
    compute = {id(m): kw["mp_policy"].param_dtype for m, kw in prim.calls}
    assert compute == {id(block.sinks): FP32, id(block): BF16}


def test_ignored_params_given_as_names_are_refused_naming_them() -> None:
    with pytest.raises(TypeError, match=r"'proj\.weight'.*get_parameter"):
        record_by_dtype(tree(proj=leaf(BF16)), ["proj.weight"])  # type: ignore[arg-type]


def test_ignored_params_given_as_one_parameter_is_refused() -> None:
    mlp = leaf(BF16)
    with pytest.raises(TypeError, match="wrap it in a set"):
        record_by_dtype(mlp, mlp.w0)  # type: ignore[arg-type]


def test_an_index_that_does_not_enter_sharded_modules_stops_at_them() -> None:
    model = make_decoder()
    fsdptx.fully_shard_by_dtype(model.layers[0], None, None, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    index = ModelIndex.build(model, enter_sharded=False)
    assert "layers.0" in index.modules and id(model.layers[0]) in index.sharded
    assert not any(f.startswith("layers.0.") for f in index.modules)
    assert not any(f.startswith("layers.0.") for f in index.param_fqn.values())
    assert any(f.startswith("layers.1.") for f in index.param_fqn.values())



def test_an_index_that_does_not_enter_sharded_modules_still_lists_their_classes() -> None:
    model = make_decoder()
    fsdptx.fully_shard_by_dtype(model.layers[0], None, None, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    index = ModelIndex.build(model, enter_sharded=False)
    assert index.module_types == [type(m) for m in index.modules.values()]


def test_has_param_answers_exactly_for_the_canonical_names() -> None:
    model = make_decoder()
    model.layers[1].attn.q.weight = model.layers[0].attn.q.weight  # tied: one canonical name
    index = ModelIndex.build(model)
    names = {f for f, _ in model.named_parameters(remove_duplicate=False)} | {"layers.0.nope.weight", "nope"}
    assert {f for f in names if index.has_param(f)} == set(index.params)


# --------------------------------------------------------------------------- block replay

REPLAY_PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
REPLAY_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


def _replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The walk positions of the blocks planning replays from here on."""
    seen: list[int] = []
    original = _replay._BlockReplay.replay

    def counting(self: _replay._BlockReplay, shapes: Any, tops: range) -> None:
        seen.extend(tops)
        original(self, shapes, tops)

    monkeypatch.setattr(_replay._BlockReplay, "replay", counting)
    return seen


def _units_in_full(model: nn.Module) -> tuple[Unit, ...]:
    """The plan's units with every block planned in full."""
    p = fsdptx.plan(model, REPLAY_PIPELINE, mp_policy=REPLAY_POLICY)
    assert p.dtype_request is not None
    return resolve_units(
        model,
        mp_policy=REPLAY_POLICY,
        offload_policy=None,
        cross_blocks=p.cross_block_requests,
        dtype_request=p.dtype_request,
        replay_blocks=False,
    )


def test_blocks_built_alike_are_replayed_from_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder(4)
    replayed = _replays(monkeypatch)
    p = fsdptx.plan(model, REPLAY_PIPELINE, mp_policy=REPLAY_POLICY)
    assert len(replayed) == 3
    assert p.units == _units_in_full(model)


def test_a_block_with_a_frozen_parameter_is_planned_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder(3)
    model.layers[1].gate.proj.weight.requires_grad_(False)
    replayed = _replays(monkeypatch)
    p = fsdptx.plan(model, REPLAY_PIPELINE, mp_policy=REPLAY_POLICY)
    index = ModelIndex.build(model)
    assert replayed == [index.walk.position[id(model.layers[2])]]
    assert p.units == _units_in_full(model)


def test_a_block_holding_a_tied_parameter_is_planned_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder(3)
    model.layers[2].mlp.up.weight = model.layers[2].mlp.down.weight
    replayed = _replays(monkeypatch)
    p = fsdptx.plan(model, REPLAY_PIPELINE, mp_policy=REPLAY_POLICY)
    index = ModelIndex.build(model)
    assert replayed == [index.walk.position[id(model.layers[1])]]
    assert p.units == _units_in_full(model)
