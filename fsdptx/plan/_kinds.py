"""What kind of transform a function is, declared where it is defined.

``compose`` fuses a run of sharding transforms: each records its request
and the units are resolved once. It needs to know, for any transform it is
given, whether it is a *request* transform (records a sharding request;
resolves nothing) or a *unit-blind* one (neither reads nor writes units, so
pending requests need not be resolved before it). Each transform says so
with a decorator that stores the kind as an attribute on the function;
``compose`` reads the attribute (seeing through a keyword-only
``functools.partial``) and imports no transform. Anything undeclared is
opaque: pending requests are resolved before it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["RequestFn", "reads_no_units", "request_of", "request_transform", "unit_blind"]

F = TypeVar("F", bound=Callable[..., Any])

# (model, plan, /, **options) -> plan with the request recorded.
RequestFn = Callable[..., Any]

_REQUEST_ATTR = "_fsdptx_request"
_UNIT_BLIND_ATTR = "_fsdptx_unit_blind"


def request_transform(request_fn: RequestFn) -> Callable[[F], F]:
    """Declare a sharding transform whose effect, inside ``compose``, is
    ``request_fn(model, plan, **options)``: it records a request and
    resolves nothing (the model index is the one ``compose`` shares
    through ``plan.scratch``)."""

    def mark(fn: F) -> F:
        setattr(fn, _REQUEST_ATTR, request_fn)
        return fn

    return mark


def unit_blind(fn: F) -> F:
    """Declare a transform that neither reads nor writes units: a fused run
    of sharding transforms goes on past it."""
    setattr(fn, _UNIT_BLIND_ATTR, True)
    return fn


def _unwrap(t: object) -> tuple[object, dict[str, Any]]:
    """A transform and its keyword options, seeing through a keyword-only
    ``functools.partial`` (one with positional args is opaque)."""
    if isinstance(t, functools.partial) and not t.args:
        return t.func, dict(t.keywords)
    return t, {}


def reads_no_units(t: object) -> bool:
    """Whether ``t`` was declared :func:`unit_blind`."""
    return getattr(_unwrap(t)[0], _UNIT_BLIND_ATTR, False) is True


def request_of(t: object) -> tuple[RequestFn, dict[str, Any]] | None:
    """The request function ``t`` was declared with (and its options), or ``None``."""
    base, options = _unwrap(t)
    fn = getattr(base, _REQUEST_ATTR, None)
    return (fn, options) if fn is not None else None
