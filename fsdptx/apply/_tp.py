"""What tensor parallelism leaves for ``apply_plan`` to mend or guard:
weights tied across TP-split modules, frozen parameters that
``parallelize_module`` re-registers as trainable, and a sequence the TP
ranks cannot split evenly under sequence parallelism."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "check_sequence_length",
    "refreeze",
    "retie",
]


def retie(find: Callable[[str], nn.Module], groups: list[list[tuple[str, str]]]) -> None:
    """Share one parameter again in each tied group after TP replaced each
    module's copy (equal values: both came from the same tensor)."""
    for group in groups:
        (first_module, first_name), *rest = group
        shared = find(first_module)._parameters[first_name]
        for fqn, name in rest:
            find(fqn).register_parameter(name, shared)


def refreeze(find: Callable[[str], nn.Module], frozen: list[str]) -> None:
    """Freeze again what was frozen before tensor parallelism: torch's
    ``SequenceParallel`` re-registers a norm's parameters as new, trainable
    ones, and a frozen norm would otherwise train."""
    for fqn in frozen:
        module_fqn, _, name = fqn.rpartition(".")
        p = find(module_fqn)._parameters[name]
        assert p is not None
        p.requires_grad_(False)


def check_sequence_length(model: nn.Module, tp_size: int) -> None:
    """Refuse, before the first collective of a forward (this hook runs
    before FSDP's), a sequence that does not split evenly over the TP ranks:
    DTensor would shard it unevenly and the ranks would disagree on every
    shape after. The sequence is dim 1 of the first positional tensor, or
    of ``input_ids`` / ``inputs_embeds``."""

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        del module
        found = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if found is None:
            found = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if isinstance(kwargs.get(k), torch.Tensor)), None)
        if found is not None and found.dim() >= 2 and found.shape[1] % tp_size:
            raise ValueError(
                f"sequence parallelism: the input's sequence length {found.shape[1]} is not divisible by the "
                f"tensor-parallel size {tp_size}; pad or cut the batch to a multiple of {tp_size} positions"
            )

    model.register_forward_pre_hook(check, prepend=True, with_kwargs=True)
