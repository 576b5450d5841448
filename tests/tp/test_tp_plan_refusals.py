"""TP plans that would compute a wrong result are refused before any change
(tied weights split two ways, a style name that does not exist), and ties
the styles split alike stay tied."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of


def tied_decoder() -> Decoder:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))
    model.lm_head.weight = model.embed_tokens.weight
    return model


@pytest.mark.parametrize(
    ("styles", "match"),
    [
        ({"embed_tokens": "rowwise", "lm_head": "rowwise"}, "output head 'lm_head' has style 'rowwise'"),
        (
            {"embed_tokens": "embedding_colwise", "lm_head": "colwise_rep"},
            r"tied parameter .*embed_tokens\.weight.*lm_head\.weight.* would be sharded differently",
        ),
    ],
    ids=["embedding-rowwise-head-rowwise", "embedding-colwise-head-colwise"],
)
def test_tied_embedding_and_head_with_styles_that_split_them_apart_are_refused_unchanged(
    styles: dict[str, str], match: str
) -> None:
    model = tied_decoder()
    before = state_of(model)
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match=match):
            FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan=styles), mesh).parallelize(model)
    assert_unchanged(before, state_of(model))
    assert model.lm_head.weight is model.embed_tokens.weight


def test_tied_embedding_and_head_split_alike_stay_tied() -> None:
    model = tied_decoder()
    styles = {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"}
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan=styles), mesh).parallelize(model)
        assert isinstance(model.embed_tokens.weight, DTensor)
    assert model.lm_head.weight is model.embed_tokens.weight


def _tied_linears() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    return model


def test_two_linears_tied_under_torch_styles_that_split_alike_stay_tied_and_run() -> None:
    model = _tied_linears()
    plan = {"0": ColwiseParallel(), "1": ColwiseParallel()}
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan=plan), mesh).parallelize(model)
        assert model[1].weight is model[0].weight and isinstance(model[0].weight, DTensor)
        assert len({id(p) for p in model.parameters()}) == 1
        model[0](torch.ones(2, 4)).sum().backward()
        assert model[0].weight.grad is not None


def test_two_linears_tied_under_torch_styles_that_split_apart_are_refused_unchanged() -> None:
    model = _tied_linears()
    before = state_of(model)
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match=r"tied parameter 0\.weight = 1\.weight would be sharded differently"):
            FSDP2Manager(FSDP2Config(mp_policy=None, tp_plan=plan), mesh).parallelize(model)
    assert_unchanged(before, state_of(model))


def test_a_style_name_that_does_not_exist_is_refused_unchanged_by_the_transform_and_the_config() -> None:
    model = tied_decoder()
    before = state_of(model)
    with pytest.raises(fsdptx.PlanningError, match=r"'lm_head': unknown style 'colwize'"):
        fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, plan={"lm_head": "colwize"}))
    with pytest.raises(ValueError, match=r"FSDP2Config.tp_plan\['lm_head'\]: unknown style 'colwize'; did you mean 'colwise'"):
        FSDP2Config(tp_plan={"lm_head": "colwize"})
    assert_unchanged(before, state_of(model))


def test_sequence_parallelism_with_an_empty_tp_plan_is_refused_unchanged() -> None:
    model = tied_decoder()
    before = state_of(model)
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        manager = FSDP2Manager(FSDP2Config(sequence_parallel=True, tp_plan={}), mesh)
        with pytest.raises(fsdptx.PlanningError, match=r"sequence_parallel=True, but the TP plan splits no module.*tp_plan=\{\}"):
            manager.plan(model)
        with pytest.raises(fsdptx.PlanningError, match="splits no module"):
            manager.parallelize(model)
    assert_unchanged(before, state_of(model))
