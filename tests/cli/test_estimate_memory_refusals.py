"""``fsdptx.estimate_memory`` checks everything it can before it plans:
a refused call names itself and the argument, and leaves the model as it
was (it would otherwise consume it: its tensors become fake)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

import moe_ep_model
from unchanged import assert_unchanged, state_of


def _llama() -> nn.Module:
    with torch.device("meta"):
        return build_preset("llama", 1)


def _no_attention() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))


SP = FSDP2Config(sequence_parallel=True)

# name -> (model, mesh shape, mesh names, config, keyword arguments, error type, message)
CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], tuple[str, ...], FSDP2Config, dict[str, Any], type[Exception], str]] = {
    "unknown optimizer": (
        _llama, (2,), ("dp",), FSDP2Config(), {"optimizer": "lion"},
        ValueError, "estimate_memory: optimizer must be one of adamw, sgd, none, got 'lion'",
    ),
    "batch as a string": (
        _llama, (2,), ("dp",), FSDP2Config(), {"batch": "1"},
        TypeError, "estimate_memory: batch must be a positive int, got '1'",
    ),
    "seq as a float": (
        _llama, (2,), ("dp",), FSDP2Config(), {"seq": 64.0},
        TypeError, "estimate_memory: seq must be a positive int, got 64.0",
    ),
    "seq as a bool": (
        _llama, (2,), ("dp",), FSDP2Config(), {"seq": True},
        TypeError, "estimate_memory: seq must be a positive int, got True",
    ),
    "batch of zero": (
        _llama, (2,), ("dp",), FSDP2Config(), {"batch": 0},
        ValueError, "estimate_memory: batch must be positive, got 0",
    ),
    "sequence not divisible by tp under SP": (
        _llama, (2, 2), ("dp", "tp"), SP, {"seq": 63},
        ValueError, "estimate_memory: seq=63 is not divisible by the tensor-parallel size 2",
    ),
    "unknown cp rotation": (
        _llama, (2, 2), ("dp", "cp"), FSDP2Config(), {"cp_rotate": "ring"},
        ValueError, "estimate_memory: cp_rotate must be one of allgather, alltoall, got 'ring'",
    ),
    "sequence the head-tail chunks of cp do not divide": (
        _llama, (2, 2), ("dp", "cp"), FSDP2Config(), {"seq": 66},
        ValueError, "estimate_memory: seq=66 is not divisible by 4 .2 x cp = 4 head-tail",
    ),
    "routing skew as a string": (
        _llama, (2,), ("dp",), FSDP2Config(), {"routing_skew": "2"},
        TypeError, "estimate_memory: routing_skew must be a number >= 1 .*got '2'",
    ),
    "routing skew below one": (
        _llama, (2,), ("dp",), FSDP2Config(), {"routing_skew": 0.5},
        ValueError, "estimate_memory: routing_skew must be a finite number >= 1 .*got 0.5",
    ),
    "routing skew not finite": (
        _llama, (2,), ("dp",), FSDP2Config(), {"routing_skew": float("inf")},
        ValueError, "estimate_memory: routing_skew must be a finite number >= 1",
    ),
    "routing skew without experts split across ep": (
        _llama, (2,), ("dp",), FSDP2Config(), {"routing_skew": 2.0},
        ValueError, "estimate_memory: routing_skew=2.0 applies to experts split across ep > 1 ranks",
    ),
    "cp without attention layers to model": (
        _no_attention, (2, 2), ("dp", "cp"), FSDP2Config(), {},
        ValueError, "estimate_memory: a cp axis > 1 needs Sequential's attention layers",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_argument_is_refused_before_the_model_is_touched(name: str) -> None:
    build, shape, names, config, kwargs, error, message = CASES[name]
    model = build()
    before = state_of(model)
    with fake_mesh(shape, names) as mesh, pytest.raises(error, match=message):
        fsdptx.estimate_memory(FSDP2Manager(config, mesh), model, **{"batch": 1, "seq": 64, **kwargs})
    assert_unchanged(before, state_of(model))


def test_something_that_is_not_a_manager_is_named() -> None:
    model = _llama()
    before = state_of(model)
    with pytest.raises(TypeError, match="estimate_memory: manager must be an fsdptx.FSDP2Manager, got FSDP2Config"):
        fsdptx.estimate_memory(FSDP2Config(), model)  # type: ignore[arg-type]
    assert_unchanged(before, state_of(model))


def test_a_model_without_a_token_embedding_is_refused_before_planning() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = state_of(model)
    with fake_mesh((2,), ("dp",)) as mesh, pytest.raises(TypeError, match="estimate_memory: Sequential has no nn.Embedding"):
        fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh), model, batch=1, seq=8)
    assert_unchanged(before, state_of(model))


def test_experts_split_across_ep_that_are_not_transformers_fused_experts_are_refused() -> None:
    """The traced step stands in for transformers' dispatch only; a model's
    own (``set_expert_parallel_mesh``) dispatch is named, model untouched."""
    with torch.device("meta"):
        model = moe_ep_model.build()
    before = state_of(model)
    with fake_mesh((4,), ("dp_shard",)) as mesh:
        moe = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
        with pytest.raises(ValueError, match=r"estimate_memory: the traced step under ep > 1 stands in for the token dispatch.*layers.0.experts \(GroupedExperts\)"):
            fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh, moe), model, batch=1, seq=8)
    assert_unchanged(before, state_of(model))
