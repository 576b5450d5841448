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
states' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..model._index import ModelIndex

__all__ = ["cast_inputs_to_fp32", "wholly_fp32_modules"]


def wholly_fp32_modules(
    units: Iterable[tuple[Sequence[str], Sequence[nn.Module], Sequence[str], torch.dtype | None]],
    index: ModelIndex | None = None,
) -> list[nn.Module]:
    """The modules of fp32 units (``(module FQNs, modules, parameter FQNs,
    compute dtype)``) whose every parameter, children's included, belongs
    to an fp32 unit. None where every unit computes in fp32: activations
    are fp32 throughout.

    ``index``, the model's index as it is now, gives each module's
    parameter names as a slice of its slots instead of a walk of the
    module; it is used only on a plain tree (no tied parameter, no shared
    module), where the two agree name for name."""
    units = list(units)
    if all(compute == torch.float32 for _fqns, _modules, _params, compute in units):
        return []
    in_fp32 = {name for _fqns, _modules, params, compute in units if compute == torch.float32 for name in params}
    names_below = _from_index(index) if index is not None and not index.tied and not index.shared_modules else None
    found: list[nn.Module] = []
    for fqns, modules, _params, compute in units:
        if compute != torch.float32:
            continue
        for fqn, module in zip(fqns, modules):
            names = names_below(module) if names_below is not None else None
            if names is None:
                names = [f"{fqn}.{n}" if fqn else n for n, _p in module.named_parameters()]
            if names and in_fp32.issuperset(names):
                found.append(module)
    return found


def _from_index(index: ModelIndex) -> Callable[[nn.Module], list[str] | None]:
    """The parameter FQNs of a module's subtree, read from ``index``'s
    slots (``None`` for a module the index did not walk)."""
    position, slot_fqn = index.walk.position, index.slot_fqn

    def names(module: nn.Module) -> list[str] | None:
        at = position.get(id(module))
        if at is None:
            return None
        first, end = index.subtree_slots(at)
        return slot_fqn[first:end]

    return names


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
