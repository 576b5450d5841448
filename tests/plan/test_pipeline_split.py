"""Splitting a model into pipeline stages is pure planning: which parts
each stage holds (an even split, ``layers_per_stage`` with the ends taking
the rest, explicit stages), which pipeline rank runs it (loop and v
placements), and each stage's own Plan, whose units own exactly the
stage's parameters under the whole model's FQNs. The model is only read."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fsdptx
from fsdptx import PipelineParallelConfig, plan_pipeline
from fsdptx.plan._stages import bubble_fraction, in_flight_microbatches, stage_ranks
from fsdptx.presets import Decoder, DecoderConfig, mixed, titan
from two_kinds import stack
from unchanged import assert_unchanged, state_of


def _decoder(layers: int, device: str = "meta") -> Decoder:
    with torch.device(device):
        return Decoder(DecoderConfig(vocab=32, dim=16, hidden=32, layers=layers))


def _blocks_per_stage(model: nn.Module, config: PipelineParallelConfig, pp: int) -> list[list[str]]:
    planned = plan_pipeline(model, fsdptx.shard_by_dtype, config, pp=pp)
    assert planned.pipeline is not None
    return [[m for m in s.modules if m.startswith("layers.")] for s in planned.pipeline.stages]


def _params_under(model: nn.Module, parts: tuple[str, ...]) -> set[str]:
    return {n for n, _ in model.named_parameters() if any(n.startswith(p + ".") for p in parts)}


@pytest.mark.parametrize(
    ("layers", "pp", "spr", "counts"),
    [(10, 4, 1, [2, 3, 3, 2]), (4, 4, 1, [1, 1, 1, 1]), (5, 2, 1, [3, 2]), (9, 2, 2, [2, 3, 2, 2]), (8, 2, 1, [4, 4])],
)
def test_an_even_split_gives_extra_blocks_to_the_middle_stages_first(layers: int, pp: int, spr: int, counts: list[int]) -> None:
    schedule = "1F1B" if spr == 1 else "Interleaved1F1B"
    blocks = _blocks_per_stage(_decoder(layers), PipelineParallelConfig(schedule=schedule, stages_per_rank=spr), pp)
    assert [len(b) for b in blocks] == counts
    assert [b for s in blocks for b in s] == [f"layers.{i}" for i in range(layers)]


def test_the_embedding_joins_the_first_stage_and_the_norm_and_head_the_last() -> None:
    planned = plan_pipeline(_decoder(4), fsdptx.shard_by_dtype, PipelineParallelConfig(), pp=2)
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == [
        ("embed_tokens", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "lm_head"),
    ]


@pytest.mark.parametrize(
    ("layers", "per", "counts"),
    [(10, 4, [1, 4, 4, 1]), (11, 3, [3, 3, 3, 2]), (12, 3, [3, 3, 3, 3]), (9, 3, [2, 3, 3, 1])],
)
def test_layers_per_stage_fills_the_middle_stages_and_the_ends_take_the_rest_the_last_less(
    layers: int, per: int, counts: list[int]
) -> None:
    blocks = _blocks_per_stage(_decoder(layers), PipelineParallelConfig(layers_per_stage=per), 4)
    assert [len(b) for b in blocks] == counts


def test_explicit_stages_are_kept_as_given() -> None:
    stages = (("embed_tokens", "layers.0"), ("layers.1", "layers.2", "layers.3", "norm", "lm_head"))
    planned = plan_pipeline(_decoder(4), fsdptx.shard_by_dtype, PipelineParallelConfig(stages=stages), pp=2)
    assert planned.pipeline is not None
    assert tuple(s.modules for s in planned.pipeline.stages) == stages


# blocks= naming the blocks of a two-class stack in an order unlike the model's
NAMED_OUT_OF_ORDER = {
    "classes": ["DenseBlock", "SparseBlock"],
    "classes reversed": ["SparseBlock", "DenseBlock"],
    "FQNs backwards": ["layers.3", "layers.2", "layers.1", "layers.0"],
}


@pytest.mark.parametrize("kinds", ["DSDS", "DDSS"], ids=["alternating", "dense first"])
@pytest.mark.parametrize("named", list(NAMED_OUT_OF_ORDER))
def test_named_blocks_are_split_in_the_models_order_whatever_order_they_are_named_in(kinds: str, named: str) -> None:
    model = stack(kinds, device="meta")
    planned = plan_pipeline(model, fsdptx.shard_by_dtype, PipelineParallelConfig(), pp=2, blocks=NAMED_OUT_OF_ORDER[named])
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == [("emb", "layers.0", "layers.1"), ("layers.2", "layers.3", "head")]
    # each stage plans the blocks it holds, in forward order
    assert [[u.modules for u in s.plan.units] for s in planned.pipeline.stages] == [
        [("layers.0",), ("layers.1",), ("",)],
        [("layers.2",), ("layers.3",), ("",)],
    ]


@pytest.mark.parametrize(
    "blocks", [["DenseBlock", "SparseBlock"], ["layers.0", "layers.1", "layers.2", "layers.3"]], ids=["classes", "FQNs"]
)
def test_a_stage_passes_over_blocks_entries_naming_only_what_other_stages_hold(blocks: list[str]) -> None:
    """Dense first: stage 0 holds no SparseBlock, stage 1 no DenseBlock; the
    transforms each stage is planned with are given the whole model's entries."""
    model = stack("DDSS", device="meta")
    by_dtype = functools.partial(fsdptx.shard_by_dtype, blocks=blocks)
    planned = plan_pipeline(model, by_dtype, PipelineParallelConfig(), pp=2, blocks=blocks)
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == [("emb", "layers.0", "layers.1"), ("layers.2", "layers.3", "head")]
    assert [{u.modules for u in s.plan.units} for s in planned.pipeline.stages] == [
        {("layers.0",), ("layers.1",), ("",)},
        {("layers.2",), ("layers.3",), ("",)},
    ]
    for stage in planned.pipeline.stages:
        assert set(p for u in stage.plan.units for p in u.params) == _params_under(model, stage.modules)


def test_a_blocks_entry_naming_no_module_of_the_model_is_refused_naming_it() -> None:
    model = stack("DDSS", device="meta")
    with pytest.raises(fsdptx.PlanningError, match="plan_pipeline: blocks entry 'MoEBlock' matches no module of TwoKinds"):
        plan_pipeline(model, fsdptx.shard_by_dtype, PipelineParallelConfig(), pp=2, blocks=["DenseBlock", "MoEBlock"])


def test_a_stages_blocks_entry_naming_no_module_of_the_whole_model_is_refused_naming_it() -> None:
    """Given only to the stages' transform, the entry is checked against the
    whole model each stage was cut from, not just the stage."""
    model = stack("DDSS", device="meta")
    by_dtype = functools.partial(fsdptx.shard_by_dtype, blocks=["DenseBlock", "SparseBlock", "layers.9"])
    with pytest.raises(
        fsdptx.PlanningError,
        match="shard_by_dtype: blocks entry 'layers.9' matches no module of TwoKinds, on this pipeline stage or any other",
    ):
        plan_pipeline(model, by_dtype, PipelineParallelConfig(), pp=2)


@pytest.mark.parametrize(
    ("num", "pp", "placement", "ranks"),
    [(4, 4, "loop", (0, 1, 2, 3)), (4, 2, "loop", (0, 1, 0, 1)), (6, 3, "loop", (0, 1, 2, 0, 1, 2)),
     (4, 2, "v", (0, 1, 1, 0)), (8, 4, "v", (0, 1, 2, 3, 3, 2, 1, 0))],
)
def test_stage_ranks_loop_round_the_ranks_or_run_down_and_back_up(num: int, pp: int, placement: str, ranks: tuple[int, ...]) -> None:
    assert stage_ranks(num, pp, placement) == ranks  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "ranks"),
    [({"schedule": "Interleaved1F1B", "stages_per_rank": 2}, (0, 1, 0, 1)),
     ({"schedule": "ZBVZeroBubble", "stages_per_rank": 2}, (0, 1, 1, 0)),
     ({"schedule": "Interleaved1F1B", "stages_per_rank": 2, "placement": "v"}, (0, 1, 1, 0))],
)
def test_a_plan_places_stages_by_the_schedules_placement_unless_given(options: dict[str, object], ranks: tuple[int, ...]) -> None:
    planned = plan_pipeline(_decoder(8), fsdptx.shard_by_dtype, PipelineParallelConfig(**options), pp=2)  # type: ignore[arg-type]
    assert planned.pipeline is not None
    assert tuple(s.rank for s in planned.pipeline.stages) == ranks
    assert planned.pipeline.stages_of(1) == tuple(s for s in planned.pipeline.stages if s.rank == 1)


PIPELINES = {
    "dtype units": fsdptx.shard_by_dtype,
    "with cross-block units": fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction),
}


@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("pp", [2, 3])
def test_every_stages_units_own_exactly_its_parts_parameters_under_the_whole_models_fqns(pipeline: str, pp: int) -> None:
    with torch.device("meta"):
        model = mixed(layers=6)  # fp32 sinks across blocks and a bf16 gate beside fp32 master weights
    planned = plan_pipeline(model, PIPELINES[pipeline], PipelineParallelConfig(), pp=pp)
    assert planned.pipeline is not None and planned.units == ()
    modules = dict(model.named_modules())
    owned_anywhere: list[str] = []
    for stage in planned.pipeline.stages:
        owned = [p for u in stage.plan.units for p in u.params]
        assert len(owned) == len(set(owned)), f"stage {stage.index}: a parameter in two units"
        assert set(owned) == _params_under(model, stage.modules), f"stage {stage.index}"
        assert all(m in modules for u in stage.plan.units for m in u.modules), f"stage {stage.index}: FQNs not the model's"
        assert stage.numel == sum(p.numel() for n, p in model.named_parameters() if n in set(owned))
        assert stage.nbytes == sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in set(owned))
        owned_anywhere += owned
    assert sorted(owned_anywhere) == sorted(n for n, _ in model.named_parameters())


def test_cross_block_holders_become_one_unit_per_stage_over_its_blocks() -> None:
    with torch.device("meta"):
        model = mixed(layers=4)
    planned = plan_pipeline(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks), PipelineParallelConfig(), pp=2)
    assert planned.pipeline is not None
    cross = [[u.modules for u in s.plan.units if u.kind == "cross-block"] for s in planned.pipeline.stages]
    assert cross == [[("layers.0.sinks", "layers.1.sinks")], [("layers.2.sinks", "layers.3.sinks")]]


def test_planning_stages_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = _decoder(4, device="cpu")
    before = state_of(model)
    planned = plan_pipeline(
        model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.reshard_policy), PipelineParallelConfig(microbatches=4), pp=2
    )
    assert planned.pipeline is not None
    assert_unchanged(before, state_of(model))
    assert type(model.layers) is nn.ModuleList and len(model.layers) == 4


def test_the_torchtitan_layout_splits_its_module_dict_blocks_and_keeps_the_rotary_tables_on_every_stage() -> None:
    with torch.device("meta"):
        model = titan(layers=4)
    planned = plan_pipeline(model, fsdptx.shard_by_dtype, PipelineParallelConfig(), pp=2)
    assert planned.pipeline is not None
    assert planned.pipeline.container == "layers"
    assert [s.modules for s in planned.pipeline.stages] == [
        ("tok_embeddings", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "output"),
    ]
    assert [[u.modules for u in s.plan.units] for s in planned.pipeline.stages] == [
        [("layers.0",), ("layers.1",), ("",)],
        [("layers.2",), ("layers.3",), ("",)],
    ]


def test_a_hugging_face_llama_splits_below_its_base_model() -> None:
    pytest.importorskip("transformers")
    import hf_zoo

    model = hf_zoo.llama()
    planned = plan_pipeline(model, fsdptx.shard_by_dtype, PipelineParallelConfig(), pp=2)
    assert planned.pipeline is not None
    assert planned.pipeline.container == "model.layers"
    assert [s.modules for s in planned.pipeline.stages] == [
        ("model.embed_tokens", "model.layers.0"),
        ("model.layers.1", "model.norm", "lm_head"),
    ]
    assert [set(p for u in s.plan.units for p in u.params) for s in planned.pipeline.stages] == [
        _params_under(model, s.modules) for s in planned.pipeline.stages
    ]


@pytest.mark.parametrize(("pp", "m", "v", "want"), [(2, 1, 1, 1 / 2), (4, 8, 1, 3 / 11), (4, 8, 2, 3 / 19), (1, 4, 1, 0.0)])
def test_the_bubble_fraction_is_idle_time_over_a_synchronous_step(pp: int, m: int, v: int, want: float) -> None:
    assert bubble_fraction(pp, m, v) == pytest.approx(want)


@pytest.mark.parametrize(
    ("schedule", "stage", "want"), [("GPipe", 0, 8), ("GPipe", 3, 8), ("1F1B", 0, 4), ("1F1B", 3, 1), ("Interleaved1F1B", 1, 3)]
)
def test_1f1b_holds_fewer_micro_batches_the_later_the_stage_and_gpipe_all(schedule: str, stage: int, want: int) -> None:
    assert in_flight_microbatches(schedule, stage, 4, 8) == want


def test_the_pipeline_is_printed_with_its_stages_and_each_stages_units() -> None:
    planned = plan_pipeline(_decoder(4), fsdptx.shard_by_dtype, PipelineParallelConfig(microbatches=4), pp=2)
    text = str(planned)
    assert "2 stages on pp=2" in text and "schedule 1F1B, 4 micro-batches" in text
    assert "stage 1 (pp rank 1)" in text and "layers.3" in text


@pytest.mark.parametrize("args", [(2, 2, 2, 4), (0, 2, 0, 4), (0, 4, 2, 9)])
def test_interleaved_orders_torch_would_not_run_are_refused(args: tuple[int, int, int, int]) -> None:
    from fsdptx.plan._stages import interleaved_1f1b_actions

    with pytest.raises(ValueError, match="is not an Interleaved1F1B step"):
        interleaved_1f1b_actions(*args)
