"""Parallelizing a model a second time: harmless when there is nothing to
do, refused before any change (naming what is already done) otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of


def small() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


def test_a_second_parallelize_with_nothing_to_do_changes_nothing() -> None:
    model = small()
    before = state_of(model)
    with fake_mesh((1,), ("dp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        p = manager.plan(model)
        assert (p.units, p.tensor_parallel, p.checkpointing) == ((), None, None)  # only reduction marks
        manager.parallelize(model)
        manager.parallelize(model)
        assert manager.plan(model) == p
    assert_unchanged(before, state_of(model))
    assert not any(isinstance(m, FSDPModule) for m in model.modules())


_AGAIN: dict[str, tuple[tuple[tuple[int, ...], tuple[str, ...]], dict[str, Any], type[Exception], str]] = {
    "fsdp": (((2,), ("dp",)), {}, fsdptx.PlanningError, r"'<root>', 'layers\.0', 'layers\.1' are already FSDP-sharded"),
    "tp": (((1, 2), ("dp", "tp")), {"mp_policy": None}, fsdptx.PlanMismatchError, r"the model is already parallelized: .* are DTensors"),
    "checkpointing": (
        ((1,), ("dp",)),
        {"mp_policy": None, "activation_checkpointing": True},
        fsdptx.PlanMismatchError,
        r"modules 'layers\.0', 'layers\.1' already have activation checkpointing",
    ),
}


@pytest.mark.parametrize("case", list(_AGAIN))
def test_a_second_parallelize_is_refused_unchanged_naming_what_is_done(case: str) -> None:
    (shape, names), settings, error, match = _AGAIN[case]
    model = small()
    with fake_mesh(shape, names) as mesh:
        manager = FSDP2Manager(FSDP2Config(**settings), mesh)
        manager.parallelize(model)
        before = state_of(model)
        with pytest.raises(error, match=match):
            manager.parallelize(model)
        assert_unchanged(before, state_of(model))
