"""Which modules get their inputs cast to fp32 at apply: those whose every
parameter computes in fp32. The answer read from the model's index (the
one-walk ``parallelize`` path) is the one a walk of each module gives."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.plan._fp32_inputs import wholly_fp32_modules  # noqa: E402
from fsdptx.model._index import ModelIndex  # noqa: E402

import hf_zoo  # noqa: E402

POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ROUTER = "mlp.gate."


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mixtral-fp32-router": lambda: hf_zoo.mixtral("meta", torch.bfloat16, keep_in_fp32=(ROUTER,)),
    "olmoe-fp32-router": lambda: hf_zoo.olmoe("meta", torch.bfloat16, keep_in_fp32=(ROUTER,)),
    "gpt-oss-sinks": lambda: hf_zoo.gpt_oss("meta", torch.bfloat16),
    "llama-fp32-master": lambda: hf_zoo.llama("meta", torch.float32),
    "qwen3-tied": lambda: hf_zoo.qwen3_tied("meta", torch.bfloat16),
}


def _found(model: nn.Module, index: ModelIndex | None) -> list[str]:
    plan = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=POLICY)
    built = ModelIndex.build(model)
    units = [(u.modules, [built.modules[f] for f in u.modules], u.params, u.compute_dtype) for u in plan.units]
    return [built.fqn_of(m) for m in wholly_fp32_modules(units, index if index is None else built)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_index_finds_the_modules_a_walk_of_each_module_finds(name: str) -> None:
    model = MODELS[name]()
    walked = _found(model, None)
    indexed = _found(model, ModelIndex.build(model))
    assert indexed == walked
    if "router" in name:  # the case the cast exists for: the routers, and nothing else
        assert walked and all(f.endswith(".mlp.gate") for f in walked)
    if name == "gpt-oss-sinks":  # sinks beside bf16 projections: the attention is only partly fp32
        assert not any(f.endswith("self_attn") for f in walked)
