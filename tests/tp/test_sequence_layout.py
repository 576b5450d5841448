"""The sequence-layout pass: what it adds, what it refuses, what it shows;
blocks by declaration or by shape; mixed precision on a tp-only mesh; the
sequence length checked before the first collective.

Refusals leave the model exactly as it was (parameters, classes, hooks).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, SequenceParallel

import fsdptx
from fsdptx import PlanningError
from fsdptx.presets import Decoder, DecoderConfig, Titan, TitanConfig
from fsdptx.testing import fake_mesh, record_collectives

import hf_zoo
from titan_pattern import explicit_plan

TITAN = TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=2, max_seq_len=16)


def _titan() -> Titan:
    torch.manual_seed(0)
    return Titan(TITAN)


def _decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything a refusal must leave alone."""
    return {
        "params": {n: (id(p), p.dtype, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()},
        "classes": {n: type(m) for n, m in model.named_modules()},
        "hooks": {n: (len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in model.named_modules()},
    }


def _assert_unchanged(before: dict[str, Any], model: nn.Module) -> None:
    after = _state(model)
    assert after["classes"] == before["classes"]
    assert after["hooks"] == before["hooks"]
    assert after["params"].keys() == before["params"].keys()
    for name, (pid, dtype, grad, value) in before["params"].items():
        now = after["params"][name]
        assert (now[0], now[1], now[2]) == (pid, dtype, grad), name
        assert torch.equal(now[3], value), name


def _sp_manager(mesh: Any, **config: Any) -> fsdptx.FSDP2Manager:
    return fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, **config), mesh)


# ----------------------------------------------------------------- refusals


def test_a_sequence_sliced_twice_is_refused_naming_both_modules_and_the_model_is_unchanged() -> None:
    """torchtitan's embedding already reduce-scatters onto Shard(1); a slice
    on the first block on top would cut the sequence again."""
    model = _titan()
    slice_again = PrepareModuleInput(input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None))
    plan = {**explicit_plan("titan"), "layers.0": slice_again}
    before = _state(model)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(PlanningError, match=r"'layers\.0'.*whole.*Shard\(1\).*'tok_embeddings'"):
            _sp_manager(mesh, tp_plan=plan).parallelize(model)
    _assert_unchanged(before, model)


def test_the_sequence_shard_into_a_module_that_reads_the_whole_sequence_is_refused() -> None:
    """The final norm hands on a plain Shard(1) tensor; a head whose plain
    input is read as Replicate would take each rank's slice for the whole."""
    model = _titan()
    plan = {
        **explicit_plan("titan"),
        "norm": SequenceParallel(use_local_output=True),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    before = _state(model)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(PlanningError, match=r"'output'.*reads its input as whole.*Shard\(1\) from 'norm'"):
            _sp_manager(mesh, tp_plan=plan).parallelize(model)
    _assert_unchanged(before, model)


def test_a_plan_that_shards_the_sequence_without_sequence_parallel_is_refused() -> None:
    model = _titan()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        config = fsdptx.FSDP2Config(mp_policy=None, tp_plan=explicit_plan("titan"))
        with pytest.raises(PlanningError, match=r"'tok_embeddings' shards the sequence.*sequence_parallel=False"):
            fsdptx.FSDP2Manager(config, mesh).plan(model)


def test_vocabulary_sharded_logits_without_loss_parallel_are_refused() -> None:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(PlanningError, match=r"'output' gives vocabulary-sharded logits but loss_parallel=False"):
            _sp_manager(mesh, tp_plan=explicit_plan("titan", loss_parallel=True)).plan(_titan())


def test_a_sequence_not_divisible_by_tp_is_refused_before_the_first_collective() -> None:
    model = _decoder()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        _sp_manager(mesh).parallelize(model)
        with record_collectives() as calls:
            with pytest.raises(ValueError, match=r"sequence length 7 is not divisible by the tensor-parallel size 2"):
                model(torch.zeros(2, 7, dtype=torch.long))
        assert calls == []
        model(torch.zeros(2, 8, dtype=torch.long))  # an even length still runs


def test_a_backbone_without_an_output_head_is_refused_under_sequence_parallelism() -> None:
    """Its output would be each rank's slice of the sequence."""
    backbone = hf_zoo.llama("meta").model
    with pytest.raises(PlanningError, match="no output head"):
        fsdptx.plan(backbone, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))


# --------------------------------------------------------- what the pass adds


def test_hybrid_and_mla_regions_left_alone_by_the_plan_get_the_whole_sequence() -> None:
    """DeepSeek-V3's plan covers its MLPs, not its MLA attention; Jamba's
    covers no block module: such regions are gathered in and sliced out,
    the norms run on the shard, nothing is marked sum."""
    for name, regions in (("deepseek_v3", ("self_attn",)), ("jamba", ("mamba", "feed_forward"))):
        model = getattr(hf_zoo, name)("meta")
        p = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))
        assert p.tensor_parallel is not None
        styles = {a.module: a.style for a in p.tensor_parallel.assignments}
        assert styles["model.layers.0.input_layernorm"] == "sequence_parallel (sp)"
        for region in regions:
            assert styles[f"model.layers.0.{region}"] == "whole_sequence (sp)", (name, region)
        assert not [k for k, v in p.reductions.items() if v == "sum"], name


def test_deepseek_v3_moe_with_a_tp_shared_expert_runs_whole_with_its_projections_in_the_plain_layout() -> None:
    """Its MoE block mixes TP projections (the shared expert) with experts
    and a router the plan leaves alone: the block runs on the whole
    sequence, the shared expert's rowwise all-reduces to Replicate."""
    model = hf_zoo.deepseek_v3("meta")
    p = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))
    assert p.tensor_parallel is not None
    styles = {a.module: a for a in p.tensor_parallel.assignments}
    assert styles["model.layers.1.mlp"].style == "whole_sequence (sp)"
    assert styles["model.layers.0.mlp"].style == "gather_sequence (sp)"  # the dense MLP: all TP
    down = styles["model.layers.1.mlp.shared_experts.down_proj"].parallel_style
    assert down.output_layouts == (Replicate(),)  # type: ignore[attr-defined]


def test_str_plan_shows_the_stream_layout_at_each_boundary() -> None:
    text = str(fsdptx.plan(_decoder(), functools.partial(fsdptx.tensor_parallel, sequence_parallel=True)))
    assert "stream (blocks in forward order, a block's children in registration order)" in text
    assert "embed_tokens             embedding: token ids -> Shard(1) DTensor" in text
    assert "layers.0                 block: Shard(1) DTensor -> Shard(1)  [takes the local Shard(1)]" in text
    assert "layers.{0..1}.attn       region: Shard(1) -> Shard(1)  [all-gather in as a Replicate DTensor]" in text
    assert "lm_head                  head: Shard(1) -> whole" in text


def test_loss_parallel_keeps_the_heads_logits_vocabulary_sharded_and_says_so() -> None:
    p = fsdptx.plan(
        _decoder(), functools.partial(fsdptx.tensor_parallel, sequence_parallel=True, loss_parallel=True)
    )
    assert p.tensor_parallel is not None and p.tensor_parallel.loss_parallel
    head = {a.module: a.parallel_style for a in p.tensor_parallel.assignments}["lm_head"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output  # type: ignore[attr-defined]
    assert "compute the loss under fsdptx.loss_parallel()" in str(p)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_loss_parallel_splits_a_head_the_plan_leaves_out_and_says_so(sequence_parallel: bool) -> None:
    model = _decoder()
    plan = {k: v for k, v in model._tp_plan.items() if k != "lm_head"}
    p = fsdptx.plan(
        model,
        functools.partial(fsdptx.tensor_parallel, plan=plan, sequence_parallel=sequence_parallel, loss_parallel=True),
    )
    assert p.tensor_parallel is not None
    head = {a.module: a for a in p.tensor_parallel.assignments}["lm_head"]
    assert head.style == "colwise (loss parallel)"
    assert head.parallel_style.output_layouts == (Shard(-1),) and not head.parallel_style.use_local_output  # type: ignore[attr-defined]
    assert "-> Shard(-1) vocab DTensor  [colwise: vocabulary-sharded logits]" in str(p)


def test_loss_parallel_without_an_output_head_is_refused() -> None:
    backbone = hf_zoo.llama("meta").model
    with pytest.raises(PlanningError, match=r"loss_parallel=True needs an output head"):
        fsdptx.plan(backbone, functools.partial(fsdptx.tensor_parallel, loss_parallel=True))


# ------------------------------------------------------------------- blocks


def test_blocks_in_a_module_dict_of_same_class_children_are_found() -> None:
    assert fsdptx.plan(_titan(), fsdptx.shard_by_dtype).dtype_request.targets == ("layers.0", "layers.1", "")  # type: ignore[union-attr]


def test_blocks_can_be_named_by_class_or_glob() -> None:
    class Layer(nn.Sequential):
        pass

    class Plain(nn.Module):  # no declaration; blocks in a Sequential
        def __init__(self) -> None:
            super().__init__()
            self.stack = nn.Sequential(*(Layer(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)))

    model = Plain()
    assert fsdptx.plan(model, fsdptx.shard_by_dtype).warnings  # nothing found by shape
    for spec in (("stack.*",), ("Layer",)):
        with fake_mesh((2,), ("dp",)) as mesh:
            p = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(blocks=spec), mesh).plan(model)
        blocks = [u.modules[0] for u in p.units if u.kind == "block"]
        assert blocks == ["stack.0", "stack.1", "stack.2"], spec
        assert not p.warnings


def test_a_blocks_entry_that_matches_nothing_is_refused_naming_it() -> None:
    with pytest.raises(PlanningError, match=r"blocks entry 'layer\.\*' matches no module"):
        fsdptx.plan(_titan(), functools.partial(fsdptx.shard_by_dtype, blocks=["layer.*"]))


def test_finding_no_blocks_is_said_on_the_first_line_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh)
        text = str(manager.plan(model))
        assert text.splitlines()[0].startswith("warning: found no blocks")
        assert "FSDP2Config(blocks=...)" in text.splitlines()[0]
        with caplog.at_level(logging.WARNING, logger="fsdptx.manager"):
            manager.parallelize(model)
    assert any("found no blocks" in r.getMessage() for r in caplog.records)


def test_checkpointing_and_sequence_parallelism_without_blocks_are_refused_naming_the_option() -> None:
    class NoBlocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.lm_head = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.embed(x))

    with pytest.raises(PlanningError, match=r"FSDP2Config\(blocks=\.\.\.\)"):
        fsdptx.plan(NoBlocks(), fsdptx.checkpoint_activations)
    with pytest.raises(PlanningError, match=r"no blocks were found.*FSDP2Config\(blocks=\.\.\.\)"):
        fsdptx.plan(NoBlocks(), functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))


def _decoder3() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=3))


class _RootBlocks(nn.Module):
    """A decoder whose blocks hang off the root directly (no container)."""

    def __init__(self) -> None:
        super().__init__()
        inner = _decoder3()
        self.embed_tokens = inner.embed_tokens
        for i, block in enumerate(inner.layers):
            self.add_module(f"block{i}", block)
        self.norm, self.lm_head = inner.norm, inner.lm_head
        self._tp_plan = {
            k.replace("layers.*", f"block{i}"): v for k, v in inner._tp_plan.items() for i in range(3)
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for i in range(3):
            h = self.get_submodule(f"block{i}")(h)
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out


@pytest.mark.parametrize(
    ("build", "blocks", "left_out"),
    [
        (_decoder3, ("layers.0",), r"'layers\.1', 'layers\.2'"),
        (_decoder3, ("layers.0", "layers.1"), r"'layers\.2'"),
        (_titan, ("layers.0",), r"'layers\.1'"),  # a ModuleDict
        (_RootBlocks, ("block0", "block2"), r"'block1'"),  # between named blocks
        (_RootBlocks, ("block0", "block1"), r"'block2'"),  # of a block's class
    ],
)
def test_sequence_parallelism_over_some_blocks_of_a_stack_is_refused_naming_the_ones_left_out(
    build: Any, blocks: tuple[str, ...], left_out: str
) -> None:
    """The blocks left out would keep their TP projections but run outside
    the layout pass, on the shard, and compute a wrong loss and gradients."""
    model = build()
    plan = explicit_plan("titan") if isinstance(model, Titan) else None
    before = _state(model)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(PlanningError, match=rf"blocks leave out {left_out} beside .*name every block"):
            _sp_manager(mesh, blocks=blocks, tp_plan=plan).parallelize(model)
        # Without SP the stream stays whole: naming fewer blocks only changes the units.
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None, blocks=blocks), mesh).plan(model)
    _assert_unchanged(before, model)


def test_the_root_named_as_a_block_is_refused_under_sequence_parallelism() -> None:
    """FSDP2Config refuses an empty block name outright; the functional
    transform refuses the root as a block once the sequence is sharded."""
    model = _decoder()
    with pytest.raises(ValueError, match=r"FSDP2Config.blocks holds an empty name"):
        fsdptx.FSDP2Config(sequence_parallel=True, blocks=("",))
    transform = functools.partial(fsdptx.tensor_parallel, sequence_parallel=True, blocks=("",))
    with pytest.raises(PlanningError, match=r"blocks= names the root.*'layers\.\*'"):
        fsdptx.plan(model, transform, mp_policy=None)


@pytest.mark.parametrize("build", [_decoder3, _titan])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_container_named_as_a_block_means_its_children(build: Any, sequence_parallel: bool) -> None:
    """``blocks=("layers",)`` plans what ``"layers.*"`` plans: each child
    checkpointed (not the container, which never runs), the last one kept
    unsharded after forward, the prefetch chains between them."""
    model = build()
    plan = explicit_plan("titan") if isinstance(model, Titan) and sequence_parallel else None
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        plans = [
            fsdptx.FSDP2Manager(
                fsdptx.FSDP2Config(
                    mp_policy=None, blocks=blocks, sequence_parallel=sequence_parallel, tp_plan=plan,
                    activation_checkpointing=True, enable_fsdp2_prefetch=True,
                ),
                mesh,
            ).plan(model)
            for blocks in (("layers",), ("layers.*",))
        ]
    assert plans[0] == plans[1]
    named = plans[0]
    children = tuple(f"layers.{i}" for i in range(len(model.layers)))
    assert named.checkpointing is not None and named.checkpointing.modules == children
    assert [u.reshard_after_forward for u in named.units if u.kind == "block"] == [True] * (len(children) - 1) + [False]
    assert [c.unit for c in named.prefetch] == list(children)


# ------------------------------------------------------- mixed precision, tp only


@pytest.mark.parametrize(("shape", "names"), [((1, 2), ("dp", "tp")), ((2,), ("tp",))])
def test_one_data_parallel_rank_with_tp_still_computes_in_the_policys_dtype(
    shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    model = _decoder()
    seen: list[torch.dtype] = []
    model.layers[0].attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with fake_mesh(shape, names) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True), mesh)
        p = manager.plan(model)
        assert [u.modules[0] for u in p.units if u.kind == "block"] == ["layers.0", "layers.1"]
        assert all(u.mp_policy is not None and u.mp_policy.param_dtype == torch.bfloat16 for u in p.units)
        manager.parallelize(model)
        model(torch.zeros(2, 8, dtype=torch.long))
    assert seen == [torch.bfloat16]
