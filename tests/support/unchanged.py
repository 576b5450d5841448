"""``state_of(model)``: everything a refused call must leave as it was.

A refusal is only safe when it comes before the first change; comparing
``state_of(model)`` before and after the refused call checks that, for the
things FSDP2, TP and checkpointing change: module classes (``fully_shard``
swaps them), forward hooks, parameter objects, dtypes, devices,
``requires_grad``, values, and the state-dict keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def state_of(model: nn.Module) -> dict[str, Any]:
    params = dict(model.named_parameters(remove_duplicate=False))
    return {
        "classes": {n: type(m) for n, m in model.named_modules()},
        "hooks": {
            n: (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
            for n, m in model.named_modules()
        },
        "param_ids": {n: id(p) for n, p in params.items()},
        "dtypes": {n: p.dtype for n, p in params.items()},
        "devices": {n: p.device for n, p in params.items()},
        "requires_grad": {n: p.requires_grad for n, p in params.items()},
        "values": {n: p.detach().clone() for n, p in params.items() if p.device.type != "meta"},
        "state_dict_keys": tuple(model.state_dict().keys()),
    }


def assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    values_before, values_after = before.pop("values"), after.pop("values")
    assert before == after
    assert values_before.keys() == values_after.keys()
    for name, value in values_before.items():
        assert torch.equal(value, values_after[name]), name
