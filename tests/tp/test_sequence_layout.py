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
    assert "stream (forward order)" in text
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
