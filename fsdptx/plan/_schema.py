"""What each field of a Plan record may hold, read from the records' own
type annotations, and the check of one value against them.

A plan file is data anyone can edit. Building a record from it checks
nothing by itself (a dataclass takes ``params="abc"`` or
``storage_dtype="bf16"`` as given), and a wrong value would surface much
later, or not at all: ``"abc"`` iterates as three parameter names. So
:func:`fsdptx.plan_from_json` checks every field against the annotation
of the record it belongs to, which is the one statement of what the field
holds: a field added to a record is checked with no change here.

Annotation forms understood: ``None``, unions, ``Literal``, ``tuple[X,
...]`` and fixed tuples, ``Mapping[str, X]``, ``bool``/``int``/``float``/
``str`` (a bool is not an int here) and classes (``isinstance``). Anything
else is not checked.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import torch

__all__ = ["field_hints", "mismatch"]

# Names the records' annotations use only for fields no plan file holds
# (Plan.scratch, Plan.verified), imported there for type checking only.
_UNCHECKED_NAMES: dict[str, Any] = {"ModelIndex": Any, "Verification": Any}


def field_hints(cls: type) -> dict[str, Any]:
    """Each dataclass field's annotation, resolved; a field whose annotation
    cannot be resolved is left unchecked (``Any``)."""
    try:
        hints = typing.get_type_hints(cls, localns=_UNCHECKED_NAMES)
    except (NameError, TypeError):
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _is_union(origin: object) -> bool:
    return origin is Union or origin is types.UnionType


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is what ``hint`` says (see the module docstring)."""
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    origin, args = get_origin(hint), get_args(hint)
    if _is_union(origin):
        return any(_fits(value, a) for a in args)
    if origin is Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return not args or (len(args) == len(value) and all(_fits(v, a) for v, a in zip(value, args)))
    if origin in (collections.abc.Mapping, dict):
        key, item = args if args else (Any, Any)
        return isinstance(value, collections.abc.Mapping) and all(
            _fits(k, key) and _fits(v, item) for k, v in value.items()
        )
    if hint is bool:
        return type(value) is bool
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _expected(hint: Any) -> str:
    """What ``hint`` asks for, as a plan file would have to write it."""
    if hint is None or hint is type(None):
        return "null"
    origin, args = get_origin(hint), get_args(hint)
    if _is_union(origin):
        return " or ".join(_expected(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list, each item {_expected(args[0])}"
        return f"a list of {len(args)} ({', '.join(_expected(a) for a in args)})" if args else "a list"
    if origin in (collections.abc.Mapping, dict):
        return f"an object mapping names to ({_expected(args[1])})" if args else "an object"
    if hint is torch.dtype:
        return 'a dtype ({"__type__": "dtype", "name": "bfloat16"})'
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if hint in names:
        return names[hint]
    if isinstance(hint, type):
        article = "an" if hint.__name__[:1] in "AEIOU" else "a"
        return f'{article} {hint.__name__} ({{"__type__": "{hint.__name__}", ...}})'
    return str(hint)


def _got(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, tuple):
        return f"a list of {len(value)}"
    if isinstance(value, collections.abc.Mapping):
        return "an object"
    if isinstance(value, torch.dtype):
        return f"the dtype {str(value).removeprefix('torch.')}"
    return f"a {type(value).__name__}"


def mismatch(value: Any, hint: Any, where: str) -> str | None:
    """``None`` when ``value`` is what ``hint`` says; else one sentence
    naming the innermost offending place (``plan.units[0].params[2]``),
    what it must be and what it is."""
    if _fits(value, hint):
        return None
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple and isinstance(value, tuple):
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) == len(value):
            for i, (v, a) in enumerate(zip(value, items)):
                inner = mismatch(v, a, f"{where}[{i}]")
                if inner is not None:
                    return inner
    if origin in (collections.abc.Mapping, dict) and isinstance(value, collections.abc.Mapping) and args:
        for k, v in value.items():
            inner = mismatch(v, args[1], f"{where}[{k!r}]")
            if inner is not None:
                return inner
    return f"{where} must be {_expected(hint)}, but is {_got(value)}"
