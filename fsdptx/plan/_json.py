"""Plans as data files: a versioned JSON schema for :class:`~fsdptx.Plan`.

A Plan is reviewed like code: written next to a test as a snapshot, produced
by ``python -m fsdptx plan --json`` in CI, compared with :func:`diff_plans`.
That needs a text form that is stable (keys sorted, one schema version) and
that reads back into an equal Plan.

The encoder is generic on purpose: it walks the fields of frozen dataclasses
and knows a handful of leaf kinds (str/int/bool/None, tuples, mappings,
torch dtypes, placements, FSDP policies, tensor-parallel styles). A field
added to any Plan dataclass is serialized without touching this module; a
dataclass added to :mod:`fsdptx.plan._types` (or :mod:`fsdptx.plan._plan`)
is found by name.

Every dataclass or special object is a JSON object with a ``"__type__"``
key; every other JSON object is a mapping, every JSON list a tuple.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import _plan, _types
from ._plan import Plan

__all__ = [
    "SCHEMA_VERSION",
    "DescribedStyle",
    "described_style_problems",
    "plan_document",
    "plan_from_document",
    "plan_from_json",
    "plan_to_json",
]

SCHEMA_VERSION = 1
_TYPE = "__type__"
# Style attributes that applying a style sets and no constructor takes.
_SET_BY_APPLYING = ("src_data_rank",)

# Torch dataclasses a Plan holds, encoded by their fields like fsdptx's own.
_TORCH_DATACLASSES: dict[str, type] = {
    "MixedPrecisionPolicy": MixedPrecisionPolicy,
    "OffloadPolicy": OffloadPolicy,
    "CPUOffloadPolicy": CPUOffloadPolicy,
}


def _plan_dataclasses() -> dict[str, type]:
    """Every dataclass defined in the Plan's module or its records' module,
    by class name: read when needed, so one added there later is decoded
    too."""
    found: dict[str, type] = {}
    for module in (sys.modules[_plan.__name__], sys.modules[_types.__name__]):
        found.update(
            (name, obj)
            for name, obj in vars(module).items()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__
        )
    return found


class DescribedStyle(ParallelStyle):
    """A tensor-parallel style read from a plan file that fsdptx cannot
    rebuild (a class other than torch's standard styles and fsdptx's own).

    It keeps the description so the plan still compares, prints and
    round-trips; :func:`fsdptx.apply_plan` refuses a plan holding one
    before any mutation (see :func:`described_style_problems`)."""

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


def described_style_problems(plan: Plan) -> list[str]:
    """One problem per TP assignment of ``plan`` whose style was read from
    a file and could not be rebuilt: such a plan can be inspected and
    diffed, but not applied."""
    tp = plan.tensor_parallel
    if tp is None:
        return []
    return [
        f"TP module {a.module!r}: its style {a.parallel_style.description.get('class')!r} was loaded from a "
        "plan file and fsdptx cannot rebuild it (only torch's ColwiseParallel, RowwiseParallel, "
        "SequenceParallel, PrepareModuleInput, PrepareModuleOutput and fsdptx's own styles are); re-plan "
        "with the style object, or replace the assignment's parallel_style before applying"
        for a in tp.assignments
        if isinstance(a.parallel_style, DescribedStyle)
    ]


# ----------------------------------------------------------------------------
# Encoding.


def _encode_placement(p: Placement) -> dict[str, Any]:
    if isinstance(p, Shard) and type(p) is Shard:
        return {_TYPE: "Shard", "dim": p.dim}
    if isinstance(p, Replicate):
        return {_TYPE: "Replicate"}
    if isinstance(p, Partial):
        return {_TYPE: "Partial", "reduce_op": p.reduce_op}
    raise TypeError(f"plan_to_json: cannot encode the placement {p!r}; only Shard, Replicate and Partial are known")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


_TORCH_STYLES: dict[str, type[ParallelStyle]] = {
    _qualified(c): c
    for c in (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput)
}


def _style_class(qualname: str) -> type[ParallelStyle] | None:
    """The class a description names, when fsdptx can rebuild it: torch's
    standard styles, or a ParallelStyle defined in fsdptx itself (imported
    by name; nothing outside the package is imported from a file)."""
    if qualname in _TORCH_STYLES:
        return _TORCH_STYLES[qualname]
    module_name, _, name = qualname.rpartition(".")
    if not module_name.startswith("fsdptx."):
        return None
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    defined_there = isinstance(found, type) and found.__module__ == module_name and found.__qualname__ == name
    return found if defined_there and issubclass(found, ParallelStyle) else None  # type: ignore[arg-type]


def _describe_style(style: ParallelStyle) -> dict[str, Any]:
    """A style as data: its class and instance attributes (layouts,
    desired layouts, ``use_local_output``, ...), each encoded as a value."""
    if isinstance(style, DescribedStyle):
        return {_TYPE: "ParallelStyle", **style.description}
    attributes = {name: _encode(value, f"style {type(style).__name__}.{name}") for name, value in vars(style).items()}
    return {_TYPE: "ParallelStyle", "class": type(style).__name__, "qualname": _qualified(type(style)), "attributes": attributes}


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {_TYPE: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, Placement):
        return _encode_placement(value)
    if isinstance(value, ParallelStyle):
        return _describe_style(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, where)
    if isinstance(value, (tuple, list)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"plan_to_json: {where} has non-string keys; only str-keyed mappings are encoded")
        return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"plan_to_json: cannot encode {where} of type {type(value).__name__}: {value!r}")


def _encode_dataclass(value: Any, where: str) -> dict[str, Any]:
    """A dataclass by its fields. Fields outside the value (``compare=False``)
    are process-local caches and are left out, except a torch style, which
    is part of what the plan does and is described structurally."""
    out: dict[str, Any] = {_TYPE: type(value).__name__}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if not f.compare and not isinstance(item, ParallelStyle):
            continue
        out[f.name] = _encode(item, f"{where}.{f.name}")
    return out


def plan_to_json(plan: Plan) -> str:
    """The plan as a stable JSON document (``"schema": 1``, keys sorted).

    Args:
        plan: the plan to write; its caches (``scratch``, ``verified``) are
            not part of its value and are left out.

    Returns:
        Indented JSON text, equal for equal plans, which
        :func:`plan_from_json` reads back into an equal plan.

    Raises:
        TypeError: ``plan`` is not a Plan, or holds a value of a kind the
            schema does not know (the message names the field).

    Example::

        text = fsdptx.plan_to_json(fsdptx.plan(model, pipeline))
        assert fsdptx.plan_from_json(text) == fsdptx.plan(model, pipeline)
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan_to_json: plan must be an fsdptx.Plan, got {type(plan).__name__}")
    return json.dumps(plan_document(plan), indent=1, sort_keys=True)


def plan_document(plan: Plan) -> dict[str, Any]:
    """The plan's schema as JSON-ready data (what :func:`plan_to_json`
    writes), for embedding in a larger document such as the CLI report."""
    return {"schema": SCHEMA_VERSION, "plan": _encode_dataclass(plan, "plan")}


# ----------------------------------------------------------------------------
# Decoding.


def _decode_placement(kind: str, data: Mapping[str, Any]) -> Placement:
    if kind == "Shard":
        return Shard(int(data["dim"]))
    if kind == "Replicate":
        return Replicate()
    return Partial(str(data["reduce_op"]))


_PLACEMENTS = ("Shard", "Replicate", "Partial")


def _rebuild_style(data: Mapping[str, Any]) -> ParallelStyle:
    """The style object for a description, or a :class:`DescribedStyle`
    when its class is not one fsdptx can rebuild, or the rebuilt object
    would not describe itself the same way."""
    description = {k: v for k, v in data.items() if k != _TYPE}
    cls = _style_class(str(description.get("qualname")))
    if cls is None:
        return DescribedStyle(description)
    attrs = {k: _decode(v, f"style.{k}") for k, v in description.get("attributes", {}).items()}
    builders: dict[str, Callable[[], ParallelStyle]] = {
        "ColwiseParallel": lambda: ColwiseParallel(
            input_layouts=_single(attrs["input_layouts"]),
            output_layouts=_single(attrs["output_layouts"]),
            use_local_output=attrs["use_local_output"],
        ),
        "RowwiseParallel": lambda: RowwiseParallel(
            input_layouts=_single(attrs["input_layouts"]),
            output_layouts=_single(attrs["output_layouts"]),
            use_local_output=attrs["use_local_output"],
        ),
        "SequenceParallel": lambda: SequenceParallel(
            sequence_dim=_single(attrs["sequence_sharding"]).dim, use_local_output=attrs["use_local_output"]
        ),
        "PrepareModuleInput": lambda: PrepareModuleInput(
            input_layouts=attrs["input_layouts"],
            desired_input_layouts=attrs["desired_input_layouts"],
            # torch records "were kwarg layouts given" as with_kwargs
            input_kwarg_layouts=dict(attrs["input_kwarg_layouts"]) if attrs["with_kwargs"] else None,
            desired_input_kwarg_layouts=dict(attrs["desired_input_kwarg_layouts"]) if attrs["with_kwargs"] else None,
            use_local_output=attrs["use_local_output"],
        ),
        "PrepareModuleOutput": lambda: PrepareModuleOutput(
            output_layouts=attrs["output_layouts"],
            desired_output_layouts=attrs["desired_output_layouts"],
            use_local_output=attrs["use_local_output"],
        ),
    }
    # Applying a style records state on it that no constructor takes (torch's
    # parallelize_module sets src_data_rank, RowwiseParallel on an embedding
    # its desired input layouts): set after construction, as applying did.
    recorded = {k: attrs.pop(k) for k in _SET_BY_APPLYING if k in attrs}
    if cls in _TORCH_STYLES.values():
        build = builders.get(cls.__name__, cls)
    else:  # fsdptx's own styles take their attributes as keyword arguments
        build = functools.partial(cls, **attrs)
    try:
        style = build()
    except (KeyError, TypeError, ValueError, AttributeError):
        return DescribedStyle(description)  # a torch version with other attributes: keep the description
    for name, value in {**attrs, **recorded}.items():
        if name not in vars(style):
            setattr(style, name, value)
    rebuilt = _describe_style(style)
    rebuilt.pop(_TYPE)
    return style if rebuilt == description else DescribedStyle(description)


def _single(layouts: Any) -> Any:
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return tuple(_decode(v, f"{where}[{i}]") for i, v in enumerate(value))
    if not isinstance(value, dict):
        return value
    kind = value.get(_TYPE)
    if kind is None:
        return {k: _decode(v, f"{where}[{k!r}]") for k, v in value.items()}
    if kind == "dtype":
        dtype = getattr(torch, str(value["name"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"plan_from_json: {where}: unknown torch dtype {value['name']!r}")
        return dtype
    if kind in _PLACEMENTS:
        return _decode_placement(kind, value)
    if kind == "ParallelStyle":
        return _rebuild_style(value)
    cls = _TORCH_DATACLASSES.get(kind) or _plan_dataclasses().get(kind)
    if cls is None:
        raise ValueError(
            f"plan_from_json: {where} has unknown type {kind!r}; the file was written by another fsdptx version"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields) - {_TYPE})
    if unknown:
        raise ValueError(
            f"plan_from_json: {where} ({kind}) has fields {unknown} this fsdptx does not know; "
            "read it with the fsdptx version that wrote it"
        )
    kwargs = {k: _decode(v, f"{where}.{k}") for k, v in value.items() if k != _TYPE}
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"plan_from_json: {where} ({kind}) cannot be built: {e}") from None


def plan_from_json(text: str) -> Plan:
    """Read a plan written by :func:`plan_to_json`.

    Torch's standard tensor-parallel styles (and fsdptx's own) are rebuilt
    from their description; any other style class is kept as a
    :class:`DescribedStyle`, and :func:`fsdptx.apply_plan` refuses such a
    plan, naming the module, before changing anything.

    Args:
        text: the JSON text (a bare ``plan_to_json`` document).

    Returns:
        The Plan, equal to the one written.

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: not JSON, another schema version, or a type or field
            this fsdptx does not know (the message names where).

    Example::

        p = fsdptx.plan_from_json(pathlib.Path("plan.json").read_text())
        print(p)
    """
    if not isinstance(text, str):
        raise TypeError(f"plan_from_json: text must be a str, got {type(text).__name__}")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"plan_from_json: not JSON: {e}") from None
    return plan_from_document(document)


def plan_from_document(document: Any) -> Plan:
    """:func:`plan_from_json` on already parsed JSON data."""
    if not isinstance(document, dict) or "schema" not in document or "plan" not in document:
        raise ValueError('plan_from_json: expected an object with "schema" and "plan" keys (from plan_to_json)')
    if document["schema"] != SCHEMA_VERSION:
        raise ValueError(
            f"plan_from_json: schema {document['schema']!r} is not supported (this fsdptx reads schema "
            f"{SCHEMA_VERSION}); use the fsdptx version that wrote the file"
        )
    plan = _decode(document["plan"], "plan")
    if not isinstance(plan, Plan):
        raise ValueError(f"plan_from_json: the document holds a {type(plan).__name__}, not a Plan")
    return plan

