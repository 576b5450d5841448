"""Argument checks for the public functions: a wrong type is named as the
argument it is, at the call, instead of surfacing as an ``AttributeError``
from deep inside torch after part of the work is done."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["require_module", "require_names"]


def require_module(value: object, argument: str, where: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise TypeError(f"{where}: {argument} must be a torch.nn.Module, got {type(value).__name__}")
    return value


def require_names(value: object, argument: str, where: str) -> tuple[str, ...]:
    """A sequence of names. A bare string is refused: iterating it would
    give its characters (``"sinks"`` would pin every name containing an
    ``i``), almost never what was meant."""
    if isinstance(value, str):
        raise TypeError(f"{where}: {argument} must be a list or tuple of names, not the string {value!r}; write [{value!r}]")
    if not isinstance(value, Iterable):
        raise TypeError(f"{where}: {argument} must be a list or tuple of names, got {type(value).__name__}")
    items = tuple(value)
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{where}: {argument} must hold names (str), got {bad!r}")
    return items
