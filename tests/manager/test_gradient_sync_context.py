"""``gradient_sync_context``: nested contexts compose, each unit gets back
the setting it had, and bad arguments are named before any unit changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdptx
from fsdptx.testing import fake_mesh


def _sharded() -> Iterator[nn.Module]:
    with fake_mesh((2,), ("dp",)) as mesh:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model


@pytest.fixture
def model() -> Iterator[nn.Module]:
    yield from _sharded()


def syncs(model: nn.Module) -> list[tuple[bool, bool]]:
    return [
        (g.reduce_grads, g.all_reduce_grads)
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]


def test_nested_context_keeps_sync_off_until_the_outer_one_exits(model: nn.Module) -> None:
    with fsdptx.gradient_sync_context(model, False):
        with fsdptx.gradient_sync_context(model, False):
            pass
        assert syncs(model) == [(False, False)] * 2
    assert syncs(model) == [(True, True)] * 2


def test_context_restores_a_sync_setting_the_user_turned_off(model: nn.Module) -> None:
    assert isinstance(model[0], FSDPModule)
    model[0].set_requires_gradient_sync(False, recurse=False)
    with fsdptx.gradient_sync_context(model, True):
        assert syncs(model) == [(True, True)] * 2
    assert syncs(model) == [(True, True), (False, False)]  # root first, then model[0]


@pytest.mark.parametrize("bad", [None, "no", 0.0, torch.tensor(True)], ids=["None", "str", "float", "tensor"])
def test_is_optimizer_step_must_be_a_bool(model: nn.Module, bad: object) -> None:
    before = syncs(model)
    with pytest.raises(TypeError, match="is_optimizer_step must be a bool"):
        with fsdptx.gradient_sync_context(model, bad):  # type: ignore[arg-type]
            pass
    assert syncs(model) == before


@pytest.mark.parametrize("bad", ["model", None, [nn.Linear(2, 2)]], ids=["str", "None", "list"])
def test_model_of_the_wrong_type_is_named(bad: object) -> None:
    with pytest.raises(TypeError, match="gradient_sync_context: model must be a torch.nn.Module"):
        with fsdptx.gradient_sync_context(bad, True):  # type: ignore[arg-type]
            pass
