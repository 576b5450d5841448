"""Pipeline parallelism refuses what it cannot run right before anything
changes: the model is compared with :func:`unchanged.state_of` after each
refusal, and every message says what to do. A plan that only runs slowly
(fewer micro-batches than stages, where the schedule allows it) is accepted
with a warning giving the idle fraction."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager, PipelineParallelConfig, PlanningError
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh
from unchanged import assert_unchanged, state_of


def _decoder(layers: int = 4) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=32, dim=16, hidden=32, layers=layers))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _config(**pipeline: Any) -> FSDP2Config:
    return FSDP2Config(mp_policy=None, pipeline_parallel=PipelineParallelConfig(**pipeline))


def _refused(model: nn.Module, config: FSDP2Config, match: str, *, pp: int = 2, error: type[Exception] = PlanningError) -> None:
    """``plan`` and ``parallelize`` both refuse, and leave ``model`` as it was."""
    before = state_of(model)
    with fake_mesh((pp, 2), ("pp", "dp")) as mesh:
        manager = FSDP2Manager(config, mesh)
        with pytest.raises(error, match=match):
            manager.plan(model)
        with pytest.raises(error, match=match):
            manager.parallelize(model, loss_fn=loss_fn)
    assert_unchanged(before, state_of(model))


def test_a_batch_the_micro_batches_do_not_divide_is_refused_before_any_stage_runs() -> None:
    for rank, name in ((0, "inputs"), (2, "target")):
        with fake_mesh((2, 2), ("pp", "dp"), rank=rank) as mesh:
            stages = FSDP2Manager(_config(microbatches=4), mesh).parallelize(_decoder(), loss_fn=loss_fn)
            assert isinstance(stages, fsdptx.PipelineStages)
            before = [state_of(m) for m in stages]
            batch = torch.zeros(6, 8, dtype=torch.long)
            with pytest.raises(ValueError, match=f"PipelineStages.step: {name} has batch size 6, which 4 micro-batches "
                               "do not divide; use a batch divisible by 4"):
                stages.step(inputs=batch if stages.is_first else None, target=batch if stages.is_last else None)
            for module, was in zip(stages, before):
                assert_unchanged(was, state_of(module))
                assert all(p.grad is None for p in module.parameters())


def test_a_missing_input_on_the_first_stage_is_refused_naming_it() -> None:
    with fake_mesh((2, 2), ("pp", "dp")) as mesh:
        stages = FSDP2Manager(_config(microbatches=2), mesh).parallelize(_decoder(), loss_fn=loss_fn)
        assert isinstance(stages, fsdptx.PipelineStages)
        with pytest.raises(ValueError, match="runs the first stage and needs inputs"):
            stages.step(target=torch.zeros(4, 8, dtype=torch.long))


@pytest.mark.parametrize(
    ("options", "pp", "match"),
    [
        ({}, 4, r"3 blocks cannot fill 4 stages \(pp=4 x stages_per_rank=1\); use fewer stages"),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 2}, 2, r"3 blocks cannot fill 4 stages \(pp=2 x stages_per_rank=2\)"),
    ],
)
def test_fewer_blocks_than_stages_are_refused(options: dict[str, Any], pp: int, match: str) -> None:
    _refused(_decoder(layers=3), _config(**options), match, pp=pp)


def test_a_blocks_entry_naming_no_module_of_the_model_is_refused_naming_it() -> None:
    config = dataclasses.replace(_config(), blocks=["Block", "MoEBlock"])
    _refused(_decoder(), config, "blocks entry 'MoEBlock' matches no module of Decoder")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"schedule": "1F1B", "stages_per_rank": 2}, "runs one stage per rank, but stages_per_rank=2; use one of Interleaved1F1B"),
        ({"schedule": "GPipe", "stages_per_rank": 3}, "runs one stage per rank, but stages_per_rank=3"),
        ({"schedule": "Interleaved1F1B"}, "runs several stages per rank; give stages_per_rank >= 2, or use 1F1B or GPipe"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "the 'v' placement puts exactly two stages on each rank"),
        ({"schedule": "DualPipeV", "stages_per_rank": 2, "placement": "loop"}, "needs placement='v'"),
        ({"schedule": "zero bubble"}, "unknown schedule 'zero bubble'; use one of 1F1B, GPipe"),
        ({"microbatches": 0}, "microbatches must be None or an int >= 1"),
        ({"stages": (("embed_tokens",),), "layers_per_stage": 2}, "give stages or layers_per_stage, not both"),
    ],
)
def test_a_schedule_and_stage_count_that_do_not_go_together_are_refused_in_the_config(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineParallelConfig(**options)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"schedule": "1F1B", "microbatches": 1}, "'1F1B' needs at least one micro-batch per stage, got microbatches=1 for "
         "2 stages; use microbatches >= 2 or schedule='GPipe'"),
        ({"schedule": "DualPipeV", "stages_per_rank": 2, "microbatches": 3}, "'DualPipeV' needs at least one micro-batch per "
         "stage, got microbatches=3 for 4 stages; use microbatches >= 4"),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 5}, "into microbatches // pp = 2 equal rounds "
         "on pp=2, which microbatches=5 does not divide into; use microbatches=4 or 6"),
        ({"schedule": "InterleavedZeroBubble", "stages_per_rank": 2, "microbatches": 7}, "microbatches=6 or 8"),
    ],
)
def test_a_micro_batch_count_torchs_schedule_would_refuse_is_refused_at_planning(options: dict[str, Any], match: str) -> None:
    _refused(_decoder(), _config(**options), match)


def test_apply_pipeline_refuses_a_plan_whose_schedule_cannot_run_its_micro_batches() -> None:
    model = _decoder()
    before = state_of(model)
    with fake_mesh((2, 2), ("pp", "dp")) as mesh:
        planned = FSDP2Manager(_config(microbatches=2), mesh).plan(model)
        assert planned.pipeline is not None
        edited = planned.replace(pipeline=dataclasses.replace(planned.pipeline, microbatches=1))
        with pytest.raises(ValueError, match="apply_pipeline: pipeline parallelism: schedule '1F1B' needs at least one"):
            fsdptx.apply_pipeline(edited, model, mesh, loss_fn=loss_fn)
    assert_unchanged(before, state_of(model))


def test_tied_embeddings_on_different_stages_are_refused_naming_both() -> None:
    model = _decoder()
    model.lm_head.weight = model.embed_tokens.weight
    _refused(
        model,
        _config(),
        r"tied parameters would live on different stages and drift apart: .*embed_tokens.weight \(stage 0\).*"
        r"lm_head.weight \(stage 1\).*Untie them \(Hugging Face: tie_word_embeddings=False\)",
    )


def test_multi_token_prediction_under_pipeline_parallelism_is_refused() -> None:
    model = _decoder()
    model.supports = SimpleNamespace(mtp_enabled=True)  # type: ignore[assignment]
    _refused(model, _config(), "has multi-token prediction enabled.*disable MTP under pipeline parallelism")


def test_a_hugging_face_model_under_sequence_parallelism_is_refused_at_planning() -> None:
    """Its forward builds positions and the causal mask from the hidden
    states' length, which on later stages would be the seq/tp shard."""
    pytest.importorskip("transformers")
    import hf_zoo

    model = hf_zoo.llama("cpu", torch.float32)
    config = FSDP2Config(mp_policy=None, sequence_parallel=True, pipeline_parallel=PipelineParallelConfig(microbatches=2))
    before = state_of(model)
    with fake_mesh((2, 2), ("pp", "tp")) as mesh:
        manager = FSDP2Manager(config, mesh)
        for call in (manager.plan, lambda m: manager.parallelize(m, loss_fn=loss_fn)):
            with pytest.raises(PlanningError, match=r"LlamaForCausalLM is a Hugging Face model.*sequence_parallel=False"):
                call(model)
        # Without SP the same mesh plans TP stages.
        planned = FSDP2Manager(dataclasses.replace(config, sequence_parallel=False), mesh).plan(model)
    assert planned.pipeline is not None and len(planned.pipeline.stages) == 2
    assert_unchanged(before, state_of(model))


def test_a_pp_dim_without_a_pipeline_configuration_is_refused() -> None:
    with fake_mesh((2, 2), ("pp", "dp")) as mesh:
        with pytest.raises(ValueError, match="a 'pp' dim of 2 ranks but no pipeline configuration; pass "
                           r"FSDP2Config\(pipeline_parallel=fsdptx.PipelineParallelConfig\(...\)\), or drop the 'pp' dim"):
            FSDP2Manager(FSDP2Config(mp_policy=None), mesh)


def test_a_pipeline_configuration_without_a_pp_dim_is_refused() -> None:
    with fake_mesh((4,), ("dp",)) as mesh:
        with pytest.raises(ValueError, match="pipeline_parallel is set but device_mesh has no 'pp' dim; build the mesh "
                           "with a 'pp' dim"):
            FSDP2Manager(_config(), mesh)


def test_layers_per_stage_that_does_not_fit_is_refused_with_the_sizes_that_do() -> None:
    _refused(
        _decoder(layers=10),
        _config(layers_per_stage=5),
        r"layers_per_stage=5 over 4 stages does not fit 10 blocks \(the first and last stages would hold 0 between them, "
        r"each needs 1..5\); with 4 stages use layers_per_stage in 3..4",
        pp=4,
    )


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ((("embed_tokens", "layers.0", "layers.1"), ("layers.3", "norm", "lm_head")), r"on several: \[\], on none: \['layers.2'\]"),
        ((("embed_tokens", "layers.0", "layers.1", "layers.2"), ("layers.2", "layers.3", "norm", "lm_head")),
         r"on several: \['layers.2'\], on none: \[\]"),
        ((("embed_tokens", "layers.0", "layers.2"), ("layers.1", "layers.3", "norm", "lm_head")),
         "must split the parts in forward order, each stage a contiguous run"),
        ((("embed_tokens", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "lm_head", "layers.9")),
         r"stages name \['layers.9'\], which are not parts of the model"),
        ((("embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"),),
         r"1 explicit stages given for 2 stages"),
    ],
    ids=["skips", "duplicates", "reorders", "unknown", "too few"],
)
def test_explicit_stages_that_skip_duplicate_or_reorder_parts_are_refused(stages: tuple[tuple[str, ...], ...], match: str) -> None:
    _refused(_decoder(), _config(stages=stages), match)


@pytest.mark.parametrize(
    ("options", "pp", "fraction"),
    [({"schedule": "GPipe", "microbatches": 1}, 2, "50%"), ({"schedule": "GPipe", "microbatches": 2}, 4, "60%"),
     ({"schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 1}, 2, "33%")],
)
def test_fewer_micro_batches_than_stages_warns_with_the_bubble_fraction(options: dict[str, Any], pp: int, fraction: str) -> None:
    stages = pp * options.get("stages_per_rank", 1)
    with fake_mesh((pp, 1), ("pp", "dp")) as mesh:
        planned = FSDP2Manager(_config(**options), mesh).plan(_decoder(layers=4))
    m = options["microbatches"]
    assert planned.warnings == (
        f"pipeline: {m} micro-batches for {stages} stages leave the pipeline idle {fraction} of each step; use at least {stages}",
    )
    assert str(planned).startswith(f"warning: {planned.warnings[0]}")


def test_enough_micro_batches_give_no_warning() -> None:
    with fake_mesh((2, 1), ("pp", "dp")) as mesh:
        assert FSDP2Manager(_config(microbatches=2), mesh).plan(_decoder()).warnings == ()
