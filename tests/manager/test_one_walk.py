"""``FSDP2Manager.parallelize`` walks its model once.

Planning, the checks that refuse a stale plan and the effects all read the
index of one walk, handed down from planning to applying. A walk lists
every module's children (``walk_model``, ``named_modules``, ``modules``,
``named_parameters`` and their kin all do), so each module of the model
here counts the reads of its child table made on fsdptx's behalf, and the
fewest reads any module saw is the number of walks. Reads made inside
torch's own effects (``parallelize_module``, ``checkpoint``,
``fully_shard``, which walk what they are given) are torch's and are not
counted.
"""

from __future__ import annotations

import collections
import sys
from typing import Any

import pytest
import torch
from torch import nn

from fsdptx import FSDP2Config, FSDP2Manager, apply_plan, caches
from fsdptx.apply._checkpoint import turn_kv_cache_off
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

_TORCH_EFFECTS = ("torch/distributed/", "torch/utils/checkpoint")
_READS: collections.Counter[int] = collections.Counter()
_COUNTING: dict[type, type] = {}


def _on_fsdptx_behalf(frame: Any) -> bool:
    """Whether the read at ``frame`` is fsdptx's: fsdptx code on the stack,
    torch's effects not."""
    ours = False
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in _TORCH_EFFECTS):
            return False
        ours = ours or "/fsdptx/" in name
        frame = frame.f_back
    return ours


def _counting_getattribute(self: nn.Module, name: str) -> Any:
    if name == "_modules" and _on_fsdptx_behalf(sys._getframe(1)):
        _READS[id(self)] += 1
    return object.__getattribute__(self, name)


def _counting(model: nn.Module) -> nn.Module:
    """``model`` with every module counting reads of its child table: its
    class becomes a subclass of the same name (blocks are found by class
    name) that counts."""
    for m in model.modules():
        cls = type(m)
        sub = _COUNTING.get(cls)
        if sub is None:
            sub = _COUNTING[cls] = type(cls.__name__, (cls,), {"__getattribute__": _counting_getattribute})
        object.__setattr__(m, "__class__", sub)
    return model


def _walks(model: nn.Module) -> int:
    """How many times every module of ``model`` was read: the walks."""
    return min(_READS[id(m)] for m in model.modules())


def _model() -> nn.Module:
    with torch.device("meta"):
        model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=3))
    _READS.clear()
    return _counting(model)


@pytest.mark.parametrize(
    "shape, names, config",
    [
        pytest.param((4,), ("dp_shard",), FSDP2Config(), id="dp"),
        pytest.param((2, 2), ("dp_shard", "cp"), FSDP2Config(), id="dp x cp, unused-parameter reduction"),
        pytest.param(
            (2, 2),
            ("dp_shard", "tp"),
            FSDP2Config(sequence_parallel=True, activation_checkpointing=True),
            id="dp x tp, sequence parallel, checkpointed",
        ),
    ],
)
@pytest.mark.parametrize("cached", [True, False], ids=["caches on", "caches off"])
def test_parallelize_walks_the_model_once(
    shape: tuple[int, ...], names: tuple[str, ...], config: FSDP2Config, cached: bool
) -> None:
    model = _model()
    with fake_mesh(shape, names) as mesh, caches(enabled=cached):
        FSDP2Manager(config, mesh).parallelize(model)
    assert _walks(model) == 1


def test_planning_then_applying_apart_walks_the_model_twice() -> None:
    """``apply_plan`` cannot know what happened to the model since the plan
    was made, so it walks it again to refuse a stale plan."""
    model = _model()
    with fake_mesh((4,), ("dp_shard",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(), mesh)
        planned = manager.plan(model)
        assert _walks(model) == 1
        apply_plan(planned, model, mesh)
    assert _walks(model) == 2


def test_the_counter_counts_a_named_modules_call_made_by_fsdptx() -> None:
    """The counter counts what it should: a ``named_modules`` call from
    fsdptx's side of the stack."""
    model = _model()
    turn_kv_cache_off(model)
    assert _walks(model) == 1


def test_a_parameter_cast_between_two_parallelize_calls_is_planned_anew() -> None:
    """Each call plans from its own walk: nothing of an earlier call's
    index is reused, so a cast model gets units for its new dtypes."""
    models = [_model(), _model()]
    models[1].to(torch.bfloat16)
    units = []
    with fake_mesh((4,), ("dp_shard",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        for model in models:
            units.append({u.storage_dtype for u in manager.plan(model).units})
            manager.parallelize(model)
    assert units == [{torch.float32}, {torch.bfloat16}]


def test_the_checks_reading_the_one_index_still_refuse_a_model_parallelized_before() -> None:
    """The already-parallelized check reads the handed-down index: a
    second ``parallelize`` of a tensor-parallel model is refused, naming
    the DTensor parameters, and changes nothing."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))
    with fake_mesh((2,), ("tp",)) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        manager.parallelize(model)
        before = {f: id(p) for f, p in model.named_parameters()}
        with pytest.raises(ValueError, match="already parallelized: .* are DTensors"):
            manager.parallelize(model)
    assert {f: id(p) for f, p in model.named_parameters()} == before
