"""The pure ``fsdptx.tensor_parallel`` transform.

It turns a TP plan (module globs -> Hugging Face style names or torch
styles) into concrete per-module torch styles recorded in the Plan, adds the
sequence-parallel boundaries, and turns ``replicated_with_grad_allreduce``
into TP-replica ``sum`` marks. It needs no mesh and touches no model, so
these tests run without any process group.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from fsdptx import Plan, PlanningError, compose, mark_reduction, plan, shard_by_dtype, tensor_parallel
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.tp import GatherSequence, ShardSequence, WholeSequence

LAYERS = 3


def _decoder() -> Decoder:
    return Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=LAYERS))


def _tp(model: nn.Module, **options: Any) -> Plan:
    return plan(model, functools.partial(tensor_parallel, **options))


def _styles(p: Plan) -> dict[str, ParallelStyle]:
    assert p.tensor_parallel is not None
    return {a.module: a.parallel_style for a in p.tensor_parallel.assignments}


def _names(p: Plan) -> dict[str, str]:
    assert p.tensor_parallel is not None
    return {a.module: a.style for a in p.tensor_parallel.assignments}


# ------------------------------------------------------------- pattern resolution


def test_a_pattern_resolves_to_every_concrete_module_it_matches() -> None:
    p = _tp(_decoder(), plan={"layers.*.attn.q_proj": "colwise"})
    assert p.tensor_parallel is not None
    assert [(a.module, a.pattern) for a in p.tensor_parallel.assignments] == [
        (f"layers.{i}.attn.q_proj", "layers.*.attn.q_proj") for i in range(LAYERS)
    ]


def test_a_star_matches_exactly_one_segment() -> None:
    assert set(_styles(_tp(_decoder(), plan={"layers.*.*.q_proj": "colwise"}))) == {
        f"layers.{i}.attn.q_proj" for i in range(LAYERS)
    }
    with pytest.raises(PlanningError, match="'layers.\\*.q_proj' matches no module"):
        _tp(_decoder(), plan={"layers.*.q_proj": "colwise"})


def test_assignments_are_in_fqn_order_whatever_the_plan_order() -> None:
    forward = _tp(_decoder(), plan={"lm_head": "colwise_rep", "embed_tokens": "embedding_rowwise"})
    backward = _tp(_decoder(), plan={"embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"})
    assert list(_names(forward)) == ["embed_tokens", "lm_head"]
    assert forward == backward


def test_a_module_matched_by_two_patterns_is_an_error() -> None:
    with pytest.raises(PlanningError, match="'layers.0.attn.q_proj' is matched by both"):
        _tp(_decoder(), plan={"layers.*.attn.q_proj": "colwise", "layers.0.attn.*": "rowwise"})


def test_the_declared_plan_is_used_by_default() -> None:
    model = _decoder()
    assert _tp(model) == _tp(model, plan=model._tp_plan)


# ------------------------------------------------------------ style names -> torch


def _layouts(style: ParallelStyle) -> tuple[type, tuple[Any, ...], tuple[Any, ...]]:
    return type(style), tuple(style.input_layouts), tuple(style.output_layouts)  # type: ignore[attr-defined]


_PLAIN: dict[str, tuple[str, tuple[type, tuple[Any, ...], tuple[Any, ...]]]] = {
    "colwise": ("layers.0.attn.q_proj", (ColwiseParallel, (Replicate(),), (Shard(-1),))),
    "rowwise": ("layers.0.attn.o_proj", (RowwiseParallel, (Shard(-1),), (Replicate(),))),
    "colwise_rep": ("lm_head", (ColwiseParallel, (Replicate(),), (Replicate(),))),
    "colwise_gather_output": ("lm_head", (ColwiseParallel, (Replicate(),), (Replicate(),))),
    "rowwise_rep": ("layers.0.attn.o_proj", (RowwiseParallel, (Replicate(),), (Replicate(),))),
    "rowwise_split_input": ("layers.0.attn.o_proj", (RowwiseParallel, (Replicate(),), (Replicate(),))),
    "embedding_rowwise": ("embed_tokens", (RowwiseParallel, (Replicate(),), (Replicate(),))),
}


@pytest.mark.parametrize("name", list(_PLAIN))
def test_style_names_map_to_torch_styles_with_the_documented_layouts(name: str) -> None:
    fqn, want = _PLAIN[name]
    assert _layouts(_styles(_tp(_decoder(), plan={fqn: name}))[fqn]) == want


# Sequence parallelism's layouts of a projection depend on its region: in
# a region whose projections are all tensor-parallel (the blocks' own plan
# here), rowwise outputs are reduce-scattered onto the sequence.
_A_STACK = {k: v for k, v in Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=1))._tp_plan.items() if k.startswith("layers")}
_SP: dict[str, tuple[str, tuple[type, tuple[Any, ...], tuple[Any, ...]]]] = {
    "rowwise": ("layers.0.attn.o_proj", (RowwiseParallel, (Shard(-1),), (Shard(1),))),
    "colwise_rep": ("lm_head", (ColwiseParallel, (Shard(1),), (Replicate(),))),
    "rowwise_rep": ("layers.0.attn.o_proj", (RowwiseParallel, (Replicate(),), (Shard(1),))),
}


@pytest.mark.parametrize("name", list(_SP))
def test_sequence_parallel_variants_put_the_stream_on_the_sequence_dim(name: str) -> None:
    fqn, want = _SP[name]
    sp_plan = {**{k: v for k, v in _A_STACK.items() if k != fqn.replace(".0.", ".*.")}, fqn: name}
    assert _layouts(_styles(_tp(_decoder(), plan=sp_plan, sequence_parallel=True))[fqn]) == want


def test_under_sequence_parallelism_the_embedding_reduce_scatters_onto_the_sequence_as_a_dtensor() -> None:
    """As torchtitan's embedding does (a reduce-scatter, not an all-reduce
    and a slice); handed on as a DTensor because models derive positions
    (rotary tables, masks) from the embedding output's length, which a
    DTensor reports whole."""
    sp_plan = {**_A_STACK, "embed_tokens": "embedding_rowwise"}
    style = _styles(_tp(_decoder(), plan=sp_plan, sequence_parallel=True))["embed_tokens"]
    assert _layouts(style) == (RowwiseParallel, (Replicate(),), (Shard(1),))
    assert not style.use_local_output  # type: ignore[attr-defined]


def test_under_sequence_parallelism_the_first_block_keeps_its_slice_of_the_sequence() -> None:
    styles = _styles(_tp(_decoder(), sequence_parallel=True))
    assert isinstance(styles["layers.0"], ShardSequence)
    assert not any(f"layers.{i}" in styles for i in range(1, LAYERS))


def test_rowwise_on_an_embedding_takes_replicated_token_ids() -> None:
    style = _styles(_tp(_decoder(), plan={"embed_tokens": "rowwise"}))["embed_tokens"]
    assert _layouts(style) == (RowwiseParallel, (Replicate(),), (Replicate(),))


def test_a_torch_style_is_used_as_given() -> None:
    mine = ColwiseParallel(output_layouts=Replicate())
    p = _tp(_decoder(), plan={"lm_head": mine})
    assert _styles(p)["lm_head"] is mine
    assert _names(p)["lm_head"].startswith("ColwiseParallel(")


def test_a_style_that_is_neither_a_name_nor_a_torch_style_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="'lm_head'"):
        _tp(_decoder(), plan={"lm_head": 3})  # type: ignore[dict-item]


def test_an_unknown_style_name_is_an_error_naming_it() -> None:
    with pytest.raises(PlanningError, match="unknown style 'diagonal'"):
        _tp(_decoder(), plan={"lm_head": "diagonal"})


# ----------------------------------------------------------- sequence parallelism


def test_sequence_parallel_adds_the_first_block_slice_norms_gathers_and_nothing_else() -> None:
    names = _names(_tp(_decoder(), sequence_parallel=True))
    declared = set(_names(_tp(_decoder())))
    added = {f: s for f, s in names.items() if f not in declared}
    want = {"norm": "sequence_parallel (sp)", "layers.0": "shard_sequence (sp)"}
    for i in range(LAYERS):
        want.update(
            {
                f"layers.{i}.attn_norm": "sequence_parallel (sp)",
                f"layers.{i}.mlp_norm": "sequence_parallel (sp)",
                f"layers.{i}.attn": "gather_sequence (sp)",
                f"layers.{i}.mlp": "gather_sequence (sp)",
            }
        )
    assert added == want


def test_sequence_parallel_norms_use_torch_sequence_parallel_and_gathers_gather_sequence() -> None:
    styles = _styles(_tp(_decoder(), sequence_parallel=True))
    assert isinstance(styles["layers.0.attn_norm"], SequenceParallel)
    assert isinstance(styles["layers.0.attn"], GatherSequence)


def test_sequence_parallel_style_entry_is_skipped_without_sequence_parallel() -> None:
    p = _tp(_decoder(), plan={"norm": "sequence_parallel"})
    assert p.tensor_parallel is not None
    assert p.tensor_parallel.assignments == ()
    assert [s[:2] for s in p.tensor_parallel.skipped] == [("norm", "sequence_parallel")]


# ------------------------------------------------- replicated_with_grad_allreduce


def test_replicated_with_grad_allreduce_becomes_sum_marks_and_no_assignment() -> None:
    p = _tp(_decoder(), plan={"layers.*.attn_norm": "replicated_with_grad_allreduce"})
    assert p.tensor_parallel is not None
    assert p.tensor_parallel.assignments == ()
    assert dict(p.reductions) == {f"layers.{i}.attn_norm.weight": "sum" for i in range(LAYERS)}
    assert [s[:2] for s in p.tensor_parallel.skipped] == [("layers.*.attn_norm", "replicated_with_grad_allreduce")]


class _NormWithChild(nn.Module):
    """A module with a direct parameter and a child holding another."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.inner = nn.Linear(4, 4)


def test_replicated_with_grad_allreduce_marks_only_direct_parameters() -> None:
    model = nn.Module()
    model.qk_norm = _NormWithChild()
    p = _tp(model, plan={"qk_norm": "replicated_with_grad_allreduce"})
    assert dict(p.reductions) == {"qk_norm.scale": "sum"}


def test_replicated_with_grad_allreduce_on_a_module_without_direct_parameters_is_an_error() -> None:
    with pytest.raises(PlanningError, match="'layers.0.attn', which holds no parameter"):
        _tp(_decoder(), plan={"layers.0.attn": "replicated_with_grad_allreduce"})


# ------------------------------------------------------- declared vs explicit plans


def _with_declared_extras() -> Decoder:
    model = _decoder()
    model._tp_plan = {
        **model._tp_plan,
        "layers.*.router": "colwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp": "all_reduce",
    }
    return model


def test_declared_entries_matching_nothing_or_without_torch_style_are_skipped_and_listed() -> None:
    p = _tp(_with_declared_extras())
    assert p.tensor_parallel is not None
    skipped = {(pattern, style): why for pattern, style, why in p.tensor_parallel.skipped}
    assert skipped == {
        ("layers.*.router", "colwise"): "matches no module",
        ("layers.*.mlp.experts", "moe_tp_experts"): "matches no module",
        ("layers.*.mlp", "all_reduce"): "no torch equivalent: left whole on every TP rank",
    }
    # A skipped style on modules that exist leaves their weights whole: the Plan's first lines say so.
    assert str(p).startswith("warning: tensor_parallel: the declared TP plan gives 'layers.*.mlp' the style 'all_reduce'")
    assert _tp(_with_declared_extras()).tensor_parallel.assignments == _tp(_decoder()).tensor_parallel.assignments  # type: ignore[union-attr]


def test_explicit_plan_entry_matching_nothing_is_an_error() -> None:
    with pytest.raises(PlanningError, match="'layers.\\*.router' matches no module"):
        _tp(_decoder(), plan={"layers.*.router": "colwise"})


def test_explicit_plan_entry_without_torch_style_is_an_error() -> None:
    with pytest.raises(PlanningError, match="'packed_colwise'"):
        _tp(_decoder(), plan={"lm_head": "packed_colwise"})


def test_every_problem_of_an_explicit_plan_is_listed_at_once() -> None:
    with pytest.raises(PlanningError) as info:
        _tp(_decoder(), plan={"nothing": "colwise", "lm_head": "diagonal"})
    assert "'nothing'" in str(info.value) and "'diagonal'" in str(info.value)


# ------------------------------------------------------------- the Plan as data


def test_str_plan_shows_the_tensor_parallel_section() -> None:
    text = str(_tp(_with_declared_extras(), sequence_parallel=True))
    assert "tensor parallel with sequence parallelism:" in text
    assert re.search(r"^  layers\.\{0\.\.2\}\.attn\.q_proj\s+colwise$", text, re.M), text
    assert "layers.*.mlp.experts" in text and "moe_tp_experts: not a torch style" in text


def test_the_transform_does_not_mutate_the_model() -> None:
    model = _decoder()
    ids = [id(p) for p in model.parameters()]
    values = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    _tp(model, sequence_parallel=True)
    assert [id(p) for p in model.parameters()] == ids
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in values.items())
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()] == hooks


def test_the_transform_works_on_a_meta_model() -> None:
    with torch.device("meta"):
        model = _decoder()
    assert _tp(model) == _tp(_decoder())


def _sum_and_mean_model() -> Decoder:
    """Declares mean marks on the norms and a sum mark via the TP plan."""
    model = _decoder()
    model._tp_plan = {**model._tp_plan, "layers.*.mlp_norm": "replicated_with_grad_allreduce"}
    model._tp_replica_reductions = {"layers.*.attn_norm": "mean", "norm": "mean"}
    return model


def test_compose_gives_the_same_plan_in_either_order_with_mark_reduction() -> None:
    model = _sum_and_mean_model()
    tp = functools.partial(tensor_parallel, sequence_parallel=True)
    one = plan(model, compose(tp, mark_reduction))
    two = plan(model, compose(mark_reduction, tp))
    assert one == two
    assert set(one.reductions.values()) == {"mean", "sum"}


def test_compose_order_with_mark_reduction_and_sharding_does_not_matter() -> None:
    model = _sum_and_mean_model()
    first = plan(model, compose(tensor_parallel, shard_by_dtype, mark_reduction))
    last = plan(model, compose(shard_by_dtype, mark_reduction, tensor_parallel))
    assert first == last


def test_conflicting_marks_from_tp_plan_and_mark_reduction_are_an_error_in_either_order() -> None:
    model = _sum_and_mean_model()
    model._tp_replica_reductions = {"layers.*.mlp_norm": "mean"}
    for pipeline in (compose(tensor_parallel, mark_reduction), compose(mark_reduction, tensor_parallel)):
        with pytest.raises(PlanningError, match="layers.0.mlp_norm.weight"):
            plan(model, pipeline)


def test_without_sequence_parallelism_no_sum_mark_is_derived_for_stream_modules() -> None:
    """Without SP the stream between TP regions is whole on every TP rank:
    a holder on it computes the same gradient everywhere, so it keeps the
    default mean (a derived sum would double its gradient)."""
    model = Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2, fp32_holders=True))
    p = plan(model, tensor_parallel)
    assert not [k for k in p.reductions if "sinks" in k]


# ------------------------------------------- sequence parallelism: boundaries


_GATHERED_QKV = {
    "layers.*.attn.q_proj": "colwise_gather_output",
    "layers.*.attn.k_proj": "colwise_gather_output",
    "layers.*.attn.v_proj": "colwise_gather_output",
    "layers.*.attn.o_proj": "rowwise_split_input",
}


def test_under_sequence_parallelism_gathered_projections_in_a_block_take_the_parents_gathered_input() -> None:
    """Olmo2's and Phi3's plans: the attention module gathers the sequence
    once, so each projection takes it replicated (the plain layout), not
    as a sequence shard it would gather again."""
    styles = _styles(_tp(_decoder(), plan=_GATHERED_QKV, sequence_parallel=True))
    assert isinstance(styles["layers.0.attn"], GatherSequence)
    q = styles["layers.0.attn.q_proj"]
    assert isinstance(q, ColwiseParallel)
    assert q.input_layouts == (Replicate(),) and q.output_layouts == (Replicate(),)
    o = styles["layers.0.attn.o_proj"]
    assert isinstance(o, RowwiseParallel) and o.output_layouts == (Shard(1),)


def test_under_sequence_parallelism_a_gathered_output_head_still_takes_the_sequence_shard() -> None:
    styles = _styles(_tp(_decoder(), sequence_parallel=True))
    head = styles["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Shard(1),)


def test_sequence_parallelism_without_tp_in_the_blocks_runs_each_region_on_the_whole_sequence() -> None:
    """A plan of embedding and head only (GPT-OSS's, Falcon-H1's): the
    blocks still run on the sequence shard (norms and residual stream),
    each attention and MLP is handed the whole sequence and slices its
    output back, and the head reads the shard the stream ends on."""
    only_ends = {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"}
    p = _tp(_decoder(), plan=only_ends, sequence_parallel=True)
    styles, names = _styles(p), _names(p)
    assert isinstance(styles["layers.0"], ShardSequence)
    for i in range(LAYERS):
        assert isinstance(styles[f"layers.{i}.attn"], WholeSequence)
        assert isinstance(styles[f"layers.{i}.mlp"], WholeSequence)
        assert names[f"layers.{i}.attn_norm"] == "sequence_parallel (sp)"
    head = styles["lm_head"]
    assert head.input_layouts == (Shard(1),)  # type: ignore[attr-defined]
    assert not any(k.startswith("layers") and v == "sum" for k, v in p.reductions.items())


@pytest.mark.parametrize(
    "plan_",
    [{}, {"layers.*.attn_norm": "sequence_parallel", "norm": SequenceParallel()}],
    ids=["empty", "only-sequence-parallel-norms"],
)
def test_sequence_parallelism_with_a_plan_that_splits_no_module_is_refused(plan_: dict[str, object]) -> None:
    with pytest.raises(PlanningError, match=r"sequence_parallel=True, but the TP plan splits no module .*tp_plan="):
        _tp(_decoder(), plan=plan_, sequence_parallel=True)


def test_an_empty_plan_without_sequence_parallelism_keeps_every_parameter_a_replica() -> None:
    p = _tp(_decoder(), plan={})
    assert p.tensor_parallel is not None and p.tensor_parallel.assignments == ()


def test_under_sequence_parallelism_a_head_outside_the_plan_gets_the_gathered_sequence_as_a_plain_tensor() -> None:
    without_head = {k: v for k, v in _decoder()._tp_plan.items() if k != "lm_head"}
    styles = _styles(_tp(_decoder(), plan=without_head, sequence_parallel=True))
    gather = styles["lm_head"]
    assert isinstance(gather, PrepareModuleInput) and gather.use_local_output


def test_under_sequence_parallelism_a_gathered_projection_under_a_parent_styled_by_the_plan_gathers_for_itself() -> None:
    """Nothing is known to gather the sequence at such a parent, so the
    projection keeps the sequence-parallel layout (input ``Shard(1)``)."""
    own = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))
    styles = _styles(_tp(_decoder(), plan={**_GATHERED_QKV, "layers.*.attn": own}, sequence_parallel=True))
    assert styles["layers.0.attn"] is own
    q = styles["layers.0.attn.q_proj"]
    assert isinstance(q, ColwiseParallel) and q.input_layouts == (Shard(1),)
