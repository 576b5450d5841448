"""Argument checks for the public functions: a wrong type is named as the
argument it is, at the call, instead of surfacing as an ``AttributeError``
from deep inside torch after part of the work is done."""

from __future__ import annotations

import operator
from typing import SupportsIndex

import torch
from torch import nn

__all__ = ["require_dtype", "require_module", "require_positive_int"]


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
