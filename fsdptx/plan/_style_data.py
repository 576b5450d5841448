"""A tensor-parallel style as data: what a Plan compares, hashes, diffs and
writes to a plan file for each of its styles.

torch's ``ParallelStyle`` classes define no equality, and the short name a
Plan shows (``RowwiseParallel(in=S(-1), out=R)``) leaves out settings that
change what the style does: ``use_local_output`` (a plain tensor or a
DTensor handed on), desired layouts, kwarg layouts, ``src_data_rank``. So a
style's value is its class and every instance attribute, each written as
JSON-ready data (:func:`describe_style`), and kept as one canonical JSON
text (:func:`style_settings`): the same description plan files hold, so a
style read back from a file equals the one written, and two styles that
behave differently never compare equal.

This module imports no other fsdptx module: the Plan's records
(:mod:`fsdptx.plan._types`) use it, and everything imports them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

__all__ = [
    "DescribedStyle",
    "MAPPING",
    "TYPE_KEY",
    "applied_attributes",
    "describe_style",
    "encode_dtype",
    "encode_mapping",
    "encode_placement",
    "qualified_name",
    "style_settings",
]

# The key that marks a JSON object as an encoded object (a dtype, a
# placement, a record) rather than a plain mapping.
TYPE_KEY = "__type__"
# The kind of an encoded mapping whose own keys include TYPE_KEY (a root
# parameter may be named "__type__"): its items are kept under "items".
MAPPING = "mapping"
# Set on a style by applying it, never by a constructor: torch's
# parallelize_module sets src_data_rank on every style (left out where it
# equals the class's default), and RowwiseParallel sets its desired input
# layouts when applied to an embedding (always (Replicate(),); derived from
# the module, so never a setting). A style describes itself the same
# before and after it was applied.
_SRC_DATA_RANK = "src_data_rank"
_APPLIED: dict[type[ParallelStyle], tuple[str, ...]] = {RowwiseParallel: ("desired_input_layouts",)}


def applied_attributes(cls: type[ParallelStyle], attributes: Mapping[str, Any]) -> set[str]:
    """The names among ``attributes`` (a style of class ``cls``, as values
    or as their encoded data) that applying the style sets, which a
    description leaves out."""
    left = {n for n in _APPLIED.get(cls, ()) if n in attributes}
    if _SRC_DATA_RANK in attributes and attributes[_SRC_DATA_RANK] == getattr(cls, _SRC_DATA_RANK, None):
        left.add(_SRC_DATA_RANK)
    return left


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class: how a description names its class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def encode_dtype(dtype: torch.dtype) -> dict[str, Any]:
    """A dtype as data: its name without ``torch.``."""
    return {TYPE_KEY: "dtype", "name": str(dtype).removeprefix("torch.")}


def encode_placement(p: Placement) -> dict[str, Any]:
    """``Shard``, ``Replicate`` or ``Partial`` as data; a subclass (a
    strided shard, say) is not one of them and raises ``TypeError``."""
    if type(p) is Shard:
        return {TYPE_KEY: "Shard", "dim": p.dim}
    if type(p) is Replicate:
        return {TYPE_KEY: "Replicate"}
    if type(p) is Partial:
        return {TYPE_KEY: "Partial", "reduce_op": p.reduce_op}
    raise TypeError(f"cannot encode the placement {p!r}; only Shard, Replicate and Partial are known")


def encode_mapping(items: dict[str, Any]) -> dict[str, Any]:
    """An encoded str-keyed mapping: the object itself, unless one of its
    keys is :data:`TYPE_KEY`, which would read back as an encoded object;
    then wrapped as ``{"__type__": "mapping", "items": ...}``."""
    return {TYPE_KEY: MAPPING, "items": items} if TYPE_KEY in items else items


_PLACEMENT_KINDS: dict[type, str] = {Shard: "Shard", Replicate: "Replicate", Partial: "Partial"}


def _value(value: Any, where: Any) -> Any:
    """One style attribute as data (what a style holds: layouts, flags,
    names, nested styles); ``TypeError`` naming the attribute for anything
    else. ``where`` is a thunk giving the attribute's name: built only for
    an error, since every style of every plan passes here."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    kind = _PLACEMENT_KINDS.get(type(value))
    if kind is not None:
        return encode_placement(value)
    if isinstance(value, (tuple, list)):
        return [_value(v, lambda i=i: f"{where()}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, torch.dtype):
        return encode_dtype(value)
    if isinstance(value, Placement):
        raise TypeError(f"{where()}: cannot encode the placement {value!r}; only Shard, Replicate and Partial are known")
    if isinstance(value, ParallelStyle):
        return describe_style(value, where())
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where()} has non-string keys; only str-keyed mappings are encoded")
        return encode_mapping({k: _value(v, lambda k=k: f"{where()}[{k!r}]") for k, v in value.items()})
    raise TypeError(f"cannot encode {where()} of type {type(value).__name__}: {value!r}")


def describe_style(style: ParallelStyle, where: str = "style") -> dict[str, Any]:
    """A style as JSON-ready data: ``{"__type__": "ParallelStyle", "class",
    "qualname", "attributes"}``, every instance attribute encoded (a
    :class:`DescribedStyle` gives back the description it was read from),
    except what applying the style records on it
    (:func:`applied_attributes`): a style does the same before and after.

    Raises:
        TypeError: an attribute holds a value of a kind plan files do not
            know (named by ``where`` and the attribute).
    """
    if isinstance(style, DescribedStyle):
        return {TYPE_KEY: "ParallelStyle", **style.description}
    cls = type(style)
    found = vars(style)
    left = applied_attributes(cls, found)
    attributes = {
        name: _value(value, lambda name=name: f"{where} {cls.__name__}.{name}")
        for name, value in found.items()
        if name not in left
    }
    return {TYPE_KEY: "ParallelStyle", "class": cls.__name__, "qualname": qualified_name(cls), "attributes": attributes}


def style_settings(style: ParallelStyle) -> str:
    """The style's value, as one canonical JSON text of
    :func:`describe_style` (keys sorted): equal exactly for styles of one
    class with equal attributes. A style holding something plan files
    cannot describe (a function, a module) is equal only to itself: its
    text names its identity, never a JSON object (it does not start with
    ``{``), so it can be told apart and refused where it must be written."""
    try:
        return json.dumps(describe_style(style), sort_keys=True, separators=(",", ":"))
    except TypeError as e:
        return f"{qualified_name(type(style))} at {id(style):#x}, not describable: {e}"


class DescribedStyle(ParallelStyle):
    """A tensor-parallel style read from a plan file that fsdptx cannot
    rebuild (a class other than torch's standard styles and fsdptx's own).

    It keeps the description so the plan still compares, prints and
    round-trips; :func:`fsdptx.apply_plan` refuses a plan holding one
    before any mutation (see :func:`fsdptx.plan._json.described_style_problems`)."""

    def __init__(self, description: Mapping[str, Any]) -> None:
        super().__init__()
        self.description = dict(description)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise RuntimeError(
            f"DescribedStyle({self.description.get('class')}) cannot be applied; "
            "apply_plan refuses plans holding one before changing anything"
        )

    def __repr__(self) -> str:
        return f"DescribedStyle({self.description.get('class')})"
