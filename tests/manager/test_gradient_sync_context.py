"""``gradient_sync_context``: nested contexts compose, each unit gets back
the setting it had, and bad arguments are named before any unit changes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdptx
from fsdptx.testing import fake_mesh, record_collectives


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


def _forward_backward(model: nn.Module) -> None:
    model(torch.ones(2, 4)).sum().backward()


def test_a_block_of_a_larger_model_is_refused_after_the_first_forward(model: nn.Module) -> None:
    _forward_backward(model)  # FSDP decides the root here
    before = syncs(model)
    with pytest.raises(RuntimeError, match=r"gradient_sync_context: model \(FSDPLinear\) is part of a larger FSDP model"):
        with fsdptx.gradient_sync_context(model[0], False):
            pass
    assert syncs(model) == before


def test_a_block_given_before_the_first_forward_is_refused_when_its_context_exits(model: nn.Module) -> None:
    with pytest.raises(RuntimeError, match="is part of a larger FSDP model"):
        with fsdptx.gradient_sync_context(model[0], False):
            _forward_backward(model)
    assert syncs(model) == [(True, True)] * 2


def test_a_container_of_blocks_is_refused_like_a_block() -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
        fully_shard(model[0][0], mesh=mesh)
        fully_shard(model[0][1], mesh=mesh)
        fully_shard(model, mesh=mesh)
        _forward_backward(model)
        with pytest.raises(RuntimeError, match=r"model \(Sequential\) is part of a larger FSDP model"):
            with fsdptx.gradient_sync_context(model[0], False):
                pass


def test_the_whole_model_defers_every_unit_after_the_first_forward(model: nn.Module) -> None:
    _forward_backward(model)
    with fsdptx.gradient_sync_context(model, False):
        assert syncs(model) == [(False, False)] * 2
    assert syncs(model) == [(True, True)] * 2


@pytest.mark.parametrize("defer", [True, False])
def test_the_managers_context_defers_exactly_when_the_config_says_so(defer: bool) -> None:
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None, defer_fsdp_grad_sync=defer), mesh)
        model = manager.parallelize(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        counts = []
        for i in range(2):
            with manager.gradient_sync_context(model, is_optimizer_step=i == 1), record_collectives() as calls:
                assert {s for s in syncs(model)} == {(not defer or i == 1,) * 2}
                _forward_backward(model)
            counts.append(sum(1 for c in calls if "reduce_scatter" in c.op))
    assert counts[1] > 0
    assert counts[0] == (0 if defer else counts[1])
