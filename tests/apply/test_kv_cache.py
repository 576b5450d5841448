"""Activation checkpointing and a model's KV cache: the Plan lists the
``use_cache`` switches applying turns off, and a Plan applied to a model
whose cache was turned on after planning is refused before any change."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx import FSDP2Config, FSDP2Manager  # noqa: E402
from fsdptx.testing import fake_mesh  # noqa: E402

from hf_zoo import llama  # noqa: E402
from unchanged import assert_unchanged, state_of  # noqa: E402

CHECKPOINTED = FSDP2Config(mp_policy=None, activation_checkpointing=True)


def _llama(use_cache: bool) -> nn.Module:
    model = llama(device="cpu")
    model.config.use_cache = use_cache
    return model


def test_the_plan_lists_the_kv_cache_checkpointing_turns_off_and_applying_turns_it_off() -> None:
    model = _llama(use_cache=True)
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = FSDP2Manager(CHECKPOINTED, mesh)
        p = manager.plan(model)
        assert p.checkpointing is not None and p.checkpointing.kv_cache_off == ("model.config.use_cache",)
        assert "turns off the KV cache (cannot be recomputed): model.config.use_cache = False" in str(p)
        assert model.config.use_cache is True  # planning only reads
        fsdptx.apply_plan(p, model, mesh)
    assert model.config.use_cache is False


def test_a_plan_applied_after_the_kv_cache_was_turned_on_is_refused_unchanged() -> None:
    model = _llama(use_cache=False)
    with fake_mesh((2,), ("dp",)) as mesh:
        p = FSDP2Manager(CHECKPOINTED, mesh).plan(model)
        assert p.checkpointing is not None and p.checkpointing.kv_cache_off == ()
        model.config.use_cache = True
        before = state_of(model)
        with pytest.raises(fsdptx.PlanMismatchError, match=r"'model.config.use_cache' is on, but was off when the plan"):
            fsdptx.apply_plan(p, model, mesh)
    assert_unchanged(before, state_of(model))
    assert model.config.use_cache is True


def test_the_kv_cache_switches_survive_a_plan_file_and_show_in_a_diff() -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        on = FSDP2Manager(CHECKPOINTED, mesh).plan(_llama(use_cache=True))
        off = FSDP2Manager(CHECKPOINTED, mesh).plan(_llama(use_cache=False))
    assert fsdptx.plan_from_json(fsdptx.plan_to_json(on)) == on
    assert "KV caches checkpointing turns off loses model.config.use_cache" in str(fsdptx.diff_plans(on, off))
