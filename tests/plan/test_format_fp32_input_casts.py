"""``str(plan)`` says which modules ``apply_plan`` feeds fp32 inputs: the
wholly fp32 modules inside a lower-precision model, exactly those the
apply step hooks, and no line where there are none."""

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
from fsdptx.plan._format import fp32_input_casts  # noqa: E402

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


def _hooked(model: nn.Module, plan: fsdptx.Plan) -> list[str]:
    """What the apply step casts, by its own rule."""
    index = ModelIndex.build(model)
    units = [(u.modules, [index.modules[f] for f in u.modules], u.params, u.compute_dtype) for u in plan.units]
    return [index.fqn_of(m) for m in wholly_fp32_modules(units, None)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_plan_lists_the_modules_apply_casts(name: str) -> None:
    model = MODELS[name]()
    plan = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=POLICY)
    hooked = _hooked(model, plan)
    assert fp32_input_casts(plan) == hooked
    lines = [line for line in str(plan).splitlines() if line.startswith("fp32 input casts:")]
    assert len(lines) == (1 if hooked else 0)
    if "router" in name:
        assert hooked and "model.layers.{0..1}.mlp.gate" in lines[0]
