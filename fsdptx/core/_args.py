"""Argument checks for the public functions: a wrong type is named as the
argument it is, at the call, instead of surfacing as an ``AttributeError``
from deep inside torch after part of the work is done."""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any, SupportsIndex

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "require_bool",
    "require_callable",
    "require_dtype",
    "require_modules",
    "require_module",
    "require_mp_policy",
    "require_offload_policy",
    "require_parameters",
    "require_positive_int",
]


def require_module(value: object, argument: str, where: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{where}: {argument} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def require_dtype(value: object, argument: str, where: str) -> torch.dtype:
    """A ``torch.dtype``: a string (``"bf16"``), ``None`` or a number would
    otherwise be compared with dtypes and silently match none of them."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{where}: {argument} must be a torch.dtype (e.g. torch.bfloat16), got {value!r}")
    return value


def require_positive_int(value: object, argument: str, where: str) -> int:
    """A positive ``int`` (``bool`` is not one): a float, NaN or string
    byte budget would fail (or loop) deep inside the caller."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{where}: {argument} must be a positive int, got {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{where}: {argument} must be positive, got {value!r}")
    return value


def require_bool(value: object, argument: str, where: str) -> bool:
    """A ``bool``: a string such as ``"False"`` is truthy and would silently
    mean the opposite."""
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {argument} must be a bool, got {type(value).__name__} {value!r}")
    return value


def require_callable(value: object, argument: str, where: str, *, optional: bool = False) -> Any:
    """A callable (or ``None`` when ``optional``), checked at the call
    rather than where it is first called, possibly after effects."""
    if value is None and optional:
        return None
    if not callable(value):
        none = " or None" if optional else ""
        raise TypeError(f"{where}: {argument} must be callable{none}, got {type(value).__name__} {value!r}")
    return value


def require_mp_policy(value: object, argument: str, where: str) -> MixedPrecisionPolicy | None:
    if value is not None and not isinstance(value, MixedPrecisionPolicy):
        raise TypeError(f"{where}: {argument} must be a MixedPrecisionPolicy or None, got {value!r}")
    return value


def require_offload_policy(value: object, argument: str, where: str) -> OffloadPolicy | None:
    if value is not None and not isinstance(value, OffloadPolicy):
        raise TypeError(f"{where}: {argument} must be an OffloadPolicy or None, got {value!r}")
    return value


def _items(value: object, argument: str, where: str, what: str) -> list[object]:
    """``value`` as a list when it is an iterable of several things: a
    string, bytes or one tensor is refused (iterating it would give its
    characters or rows, silently)."""
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {argument} must be an iterable of {what}, got one {type(value).__name__}; wrap it in a set")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{where}: {argument} must be an iterable of {what}, got {type(value).__name__}")
    return list(value)


def require_parameters(value: object, argument: str, where: str) -> list[nn.Parameter]:
    """An iterable of ``nn.Parameter`` objects, every one checked: a name or
    a plain tensor would otherwise match no parameter and be dropped."""
    items = _items(value, argument, where, "nn.Parameter objects")
    bad = [p for p in items if not isinstance(p, nn.Parameter)]
    if bad:
        shown = ", ".join(repr(p) if isinstance(p, str) else type(p).__name__ for p in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise TypeError(
            f"{where}: {argument} must hold nn.Parameter objects, got {shown}{more}; "
            "pass module.get_parameter(name) for a name"
        )
    return [p for p in items if isinstance(p, nn.Parameter)]


def require_modules(value: object, argument: str, where: str) -> list[nn.Module]:
    """One module, or an iterable of them (the model parts a rank holds)."""
    if isinstance(value, nn.Module):
        return [value]
    items = _items(value, argument, where, "nn.Module (or one nn.Module)")
    for i, m in enumerate(items):
        require_module(m, f"{argument}[{i}]", where)
    return [m for m in items if isinstance(m, nn.Module)]

