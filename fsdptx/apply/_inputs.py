"""Feed an fp32 unit its inputs in fp32.

An fp32 unit's policy does not cast its forward inputs (see
:func:`fsdptx.core._policy.mp_policy_with_param_dtype`): a unit holding only
some of a module's parameters (GPT-OSS's sinks on an attention module whose
projections compute in bf16) must leave the module's inputs to the module.
A module whose every parameter computes in fp32, though, is a wholly fp32
computation: an MoE router kept fp32 inside a bf16 block, whose forward is
``F.linear(hidden_states, self.weight)`` with bf16 hidden states and would
fail with ``expected m1 and m2 to have the same dtype``. Such a module gets
a forward pre-hook that casts its floating inputs to fp32. Its outputs are
what the module computes from fp32 inputs, as in a model that keeps the
module fp32 itself (Hugging Face's keep-in-fp32 loading): the routing
weights come out fp32 and the experts cast their sum back to the hidden
states' dtype. Which modules those are: :mod:`fsdptx.plan._fp32_inputs`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["cast_inputs_to_fp32"]


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def _cast_hook(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    del module
    return tuple(_to_fp32(a) for a in args), {k: _to_fp32(v) for k, v in kwargs.items()}


def cast_inputs_to_fp32(module: nn.Module) -> None:
    """Cast ``module``'s floating tensor arguments (positional and keyword)
    to fp32 before its forward; integer tensors and fp32 ones pass as they are."""
    module.register_forward_pre_hook(_cast_hook, with_kwargs=True)
