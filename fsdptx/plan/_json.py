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
key; every other JSON object is a mapping (one whose own keys include
``"__type__"``, such as the marks of a root parameter named so, is written
``{"__type__": "mapping", "items": {...}}``), every JSON list a tuple.

A file is data anyone can edit, so reading one checks everything before it
builds anything: every field against its record's annotation
(:mod:`fsdptx.plan._schema`), every special object's keys and values, every
torch style's attributes; the first problem is a ``ValueError`` naming the
field's path (``plan.units[0].storage_dtype``) and what it must be.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import typing
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

from . import _plan, _types
from ._plan import Plan
from ._schema import field_hints, mismatch
from ._style_data import (
    MAPPING,
    TYPE_KEY,
    DescribedStyle,
    applied_attributes,
    describe_style,
    encode_dtype,
    encode_mapping,
    encode_placement,
    qualified_name,
)

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


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return encode_dtype(value)
    if isinstance(value, Placement):
        try:
            return encode_placement(value)
        except TypeError as e:
            raise TypeError(f"plan_to_json: {where}: {e}") from None
    if isinstance(value, ParallelStyle):
        try:
            return describe_style(value, where)
        except TypeError as e:
            raise TypeError(f"plan_to_json: {e}") from None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, where)
    if isinstance(value, (tuple, list)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"plan_to_json: {where} has non-string keys; only str-keyed mappings are encoded")
        return encode_mapping({k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()})
    raise TypeError(f"plan_to_json: cannot encode {where} of type {type(value).__name__}: {value!r}")


def _encode_dataclass(value: Any, where: str) -> dict[str, Any]:
    """A dataclass by its fields: each argument of the record that is part
    of its value, and a torch style, which has no value of its own. Derived
    fields and process-local caches (``compare=False``) are left out. A TP
    assignment's style is written as its settings, taken when the
    assignment was made (applying a style changes some attributes)."""
    out: dict[str, Any] = {TYPE_KEY: type(value).__name__}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if not f.init or not (f.compare or isinstance(item, ParallelStyle)):
            continue
        if isinstance(value, _types.TPAssignment) and f.name == "parallel_style":
            if not value.settings.startswith("{"):
                raise TypeError(f"plan_to_json: {where}.parallel_style: {value.settings}")
            out[f.name] = json.loads(value.settings)
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


_TORCH_STYLES: dict[str, type[ParallelStyle]] = {
    qualified_name(c): c
    for c in (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput)
}

_Layouts = tuple[Placement, ...]
_OptionalLayouts = tuple[Placement | None, ...]
# What each attribute of torch's standard styles holds (torch keeps single
# layouts as 1-tuples). An attribute not listed here is one another torch
# version has: such a style is kept as a DescribedStyle.
_TORCH_STYLE_ATTRIBUTES: dict[type[ParallelStyle], dict[str, Any]] = {
    ColwiseParallel: {
        "input_layouts": _Layouts,
        "output_layouts": _Layouts,
        "desired_input_layouts": _Layouts,
        "use_local_output": bool,
    },
    RowwiseParallel: {
        "input_layouts": _Layouts,
        "output_layouts": _Layouts,
        "desired_input_layouts": _Layouts,  # set by applying it to an embedding
        "use_local_output": bool,
    },
    SequenceParallel: {"sequence_sharding": _Layouts, "use_local_output": bool},
    PrepareModuleInput: {
        "input_layouts": _OptionalLayouts | None,
        "desired_input_layouts": _OptionalLayouts | None,
        "input_kwarg_layouts": Mapping[str, Placement],
        "desired_input_kwarg_layouts": Mapping[str, Placement],
        "with_kwargs": bool,
        "use_local_output": bool,
    },
    PrepareModuleOutput: {
        "output_layouts": _OptionalLayouts,
        "desired_output_layouts": _Layouts,
        "use_local_output": bool,
    },
}
# Set on a style by applying it (torch's parallelize_module), never by a
# constructor: a value other than the class's default is set after
# construction, as applying did.
_SRC_DATA_RANK = "src_data_rank"


def _style_attribute_hints(cls: type[ParallelStyle]) -> dict[str, Any]:
    """What each attribute of a style of class ``cls`` may hold: the table
    above for torch's styles, the constructor's annotations for fsdptx's
    own (which take their attributes as keyword arguments)."""
    if cls in _TORCH_STYLE_ATTRIBUTES:
        hints = dict(_TORCH_STYLE_ATTRIBUTES[cls])
    else:
        try:
            hints = typing.get_type_hints(cls.__init__)
        except (NameError, TypeError):
            hints = {}
        hints.pop("return", None)
    return {**hints, _SRC_DATA_RANK: int | None}


def _single(layouts: Any) -> Any:
    return layouts[0] if isinstance(layouts, tuple) and len(layouts) == 1 else layouts


_BUILDERS: dict[type[ParallelStyle], Callable[[dict[str, Any]], ParallelStyle]] = {
    ColwiseParallel: lambda a: ColwiseParallel(
        input_layouts=_single(a["input_layouts"]),
        output_layouts=_single(a["output_layouts"]),
        use_local_output=a["use_local_output"],
    ),
    RowwiseParallel: lambda a: RowwiseParallel(
        input_layouts=_single(a["input_layouts"]),
        output_layouts=_single(a["output_layouts"]),
        use_local_output=a["use_local_output"],
    ),
    SequenceParallel: lambda a: SequenceParallel(
        sequence_dim=_single(a["sequence_sharding"]).dim, use_local_output=a["use_local_output"]
    ),
    PrepareModuleInput: lambda a: PrepareModuleInput(
        input_layouts=a["input_layouts"],
        desired_input_layouts=a["desired_input_layouts"],
        # torch records "were kwarg layouts given" as with_kwargs
        input_kwarg_layouts=dict(a["input_kwarg_layouts"]) if a["with_kwargs"] else None,
        desired_input_kwarg_layouts=dict(a["desired_input_kwarg_layouts"]) if a["with_kwargs"] else None,
        use_local_output=a["use_local_output"],
    ),
    PrepareModuleOutput: lambda a: PrepareModuleOutput(
        output_layouts=a["output_layouts"],
        desired_output_layouts=a["desired_output_layouts"],
        use_local_output=a["use_local_output"],
    ),
}


# Integer fields that count something, which their annotation (int) does
# not say cannot be negative.
_COUNTS: dict[str, tuple[str, ...]] = {"Unit": ("numel", "nbytes"), "ExpertParallel": ("num_experts",)}


def _problem(where: str, message: str) -> ValueError:
    return ValueError(f"plan_from_json: {where}: {message}")


def _check_keys(data: Mapping[str, Any], where: str, kind: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """``data`` (an encoded ``kind``) has every required key and no other."""
    unknown = sorted(set(data) - set(required) - set(optional) - {TYPE_KEY})
    if unknown:
        raise ValueError(
            f"plan_from_json: {where} ({kind}) has fields {unknown} this fsdptx does not know; "
            "read it with the fsdptx version that wrote it"
        )
    missing = [k for k in required if k not in data]
    if missing:
        raise _problem(where, f"a {kind} needs the field(s) {missing}")


class _Reader:
    """One document's decoding: the record classes and their field
    annotations are looked up once per document, not once per record."""

    def __init__(self) -> None:
        self.classes = {**_TORCH_DATACLASSES, **_plan_dataclasses()}
        self.hints: dict[type, dict[str, Any]] = {}

    def value(self, data: Any, where: str) -> Any:
        if isinstance(data, list):
            return tuple(self.value(v, f"{where}[{i}]") for i, v in enumerate(data))
        if not isinstance(data, dict):
            return data
        kind = data.get(TYPE_KEY)
        if kind is None:
            return {k: self.value(v, f"{where}[{k!r}]") for k, v in data.items()}
        if not isinstance(kind, str):
            raise _problem(where, f'"{TYPE_KEY}" must name a type (a string), but is {json.dumps(kind)}')
        if kind == MAPPING:
            _check_keys(data, where, kind, ("items",))
            if not isinstance(data["items"], dict):
                raise _problem(f"{where}.items", "must be an object")
            return {k: self.value(v, f"{where}[{k!r}]") for k, v in data["items"].items()}
        if kind == "dtype":
            _check_keys(data, where, kind, ("name",))
            dtype = getattr(torch, data["name"], None) if isinstance(data["name"], str) else None
            if not isinstance(dtype, torch.dtype):
                raise _problem(where, f"unknown torch dtype {json.dumps(data['name'])}")
            return dtype
        if kind in ("Shard", "Replicate", "Partial"):
            return self.placement(kind, data, where)
        if kind == "ParallelStyle":
            return self.style(data, where)
        cls = self.classes.get(kind)
        if cls is None:
            raise ValueError(
                f"plan_from_json: {where} has unknown type {kind!r}; the file was written by another fsdptx version"
            )
        return self.record(cls, kind, data, where)

    def placement(self, kind: str, data: dict[str, Any], where: str) -> Placement:
        if kind == "Replicate":
            _check_keys(data, where, kind, ())
            return Replicate()
        field = "dim" if kind == "Shard" else "reduce_op"
        _check_keys(data, where, kind, (field,))
        value = data[field]
        if kind == "Shard":
            if isinstance(value, bool) or not isinstance(value, int):
                raise _problem(f"{where}.dim", f"must be an integer, but is {json.dumps(value)}")
            return Shard(value)
        if not isinstance(value, str):
            raise _problem(f"{where}.reduce_op", f"must be a string such as \"sum\", but is {json.dumps(value)}")
        return Partial(value)

    def record(self, cls: type, kind: str, data: dict[str, Any], where: str) -> Any:
        hints = self.hints.get(cls)
        if hints is None:
            hints = self.hints[cls] = field_hints(cls)
        fields = {
            f.name: f for f in dataclasses.fields(cls) if f.init and (f.compare or hints[f.name] is ParallelStyle)
        }
        required = tuple(
            n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        _check_keys(data, where, kind, required, tuple(fields))
        kwargs = {k: self.value(v, f"{where}.{k}") for k, v in data.items() if k != TYPE_KEY}
        for name, value in kwargs.items():
            problem = mismatch(value, hints[name], f"{where}.{name}")
            if problem is not None:
                raise ValueError(f"plan_from_json: {problem}")
        for name in _COUNTS.get(kind, ()):
            counts = kwargs.get(name, 0)
            if any(c < 0 for c in (counts if isinstance(counts, tuple) else (counts,))):
                raise _problem(f"{where}.{name}", f"must not be negative, but is {json.dumps(data[name])}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"plan_from_json: {where} ({kind}) cannot be built: {e}") from None

    def style(self, data: dict[str, Any], where: str) -> ParallelStyle:
        """The style object for a description, or a :class:`DescribedStyle`
        when its class is not one fsdptx can rebuild, has attributes this
        torch does not know, or the rebuilt object would not describe
        itself the same way. An attribute of a known kind that holds the
        wrong thing is refused."""
        _check_keys(data, where, "ParallelStyle", ("class", "qualname", "attributes"))
        for key in ("class", "qualname"):
            if not isinstance(data[key], str):
                raise _problem(f"{where}.{key}", f"must be a string, but is {json.dumps(data[key])}")
        if not isinstance(data["attributes"], dict):
            raise _problem(f"{where}.attributes", "must be an object")
        cls = _style_class(data["qualname"])
        attrs = {k: self.value(v, f"{where}.attributes.{k}") for k, v in data["attributes"].items()}
        description = {k: v for k, v in data.items() if k != TYPE_KEY}
        if cls is None:
            return DescribedStyle(description)
        hints = _style_attribute_hints(cls)
        for name, value in attrs.items():
            if name in hints:
                problem = mismatch(value, hints[name], f"{where}.attributes.{name}")
                if problem is not None:
                    raise ValueError(f"plan_from_json: {problem}")
        applied = applied_attributes(cls, attrs)
        if applied:  # written by an fsdptx that kept what applying records: the same style
            attrs = {k: v for k, v in attrs.items() if k not in applied}
            description["attributes"] = {k: v for k, v in data["attributes"].items() if k not in applied}
        if cls in _TORCH_STYLE_ATTRIBUTES and not set(attrs) <= set(hints):
            return DescribedStyle(description)  # a torch version with other attributes
        after = {k: attrs.pop(k) for k in (_SRC_DATA_RANK,) if k in attrs}
        build = _BUILDERS.get(cls)
        try:
            style = build(attrs) if build is not None else cls(**attrs)
        except (KeyError, TypeError, ValueError, AttributeError):
            return DescribedStyle(description)  # a torch version with other attributes: keep the description
        for name, value in after.items():
            setattr(style, name, value)
        rebuilt = describe_style(style)
        rebuilt.pop(TYPE_KEY)
        return style if rebuilt == description else DescribedStyle(description)


def plan_from_json(text: str) -> Plan:
    """Read a plan written by :func:`plan_to_json`.

    Torch's standard tensor-parallel styles (and fsdptx's own) are rebuilt
    from their description; any other style class is kept as a
    :class:`DescribedStyle`, and :func:`fsdptx.apply_plan` refuses such a
    plan, naming the module, before changing anything. Every field is
    checked against what its record declares it holds, every special
    object (dtype, placement, style) against its own form, before
    anything is built.

    Args:
        text: the JSON text (a bare ``plan_to_json`` document).

    Returns:
        The Plan, equal to the one written.

    Raises:
        TypeError: ``text`` is not a str.
        ValueError: not JSON, another schema version, a type or field
            this fsdptx does not know, or a field holding the wrong kind of
            value (the message names the field's path and what it must be).

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
    except RecursionError:
        raise ValueError("plan_from_json: the JSON is nested too deeply to be a plan") from None
    return plan_from_document(document)


def plan_from_document(document: Any) -> Plan:
    """:func:`plan_from_json` on already parsed JSON data."""
    if not isinstance(document, dict) or "schema" not in document or "plan" not in document:
        raise ValueError('plan_from_json: expected an object with "schema" and "plan" keys (from plan_to_json)')
    unknown = sorted(set(document) - {"schema", "plan"})
    if unknown:
        raise ValueError(f"plan_from_json: the document has keys {unknown} besides \"schema\" and \"plan\"; not a plan_to_json document")
    schema = document["schema"]
    if type(schema) is not int or schema != SCHEMA_VERSION:
        raise ValueError(
            f"plan_from_json: schema {json.dumps(schema)} is not supported (this fsdptx reads schema "
            f"{SCHEMA_VERSION}); use the fsdptx version that wrote the file"
        )
    body = document["plan"]
    if not isinstance(body, dict) or body.get(TYPE_KEY) != "Plan":
        raise ValueError(f'plan_from_json: "plan" must be an object with "{TYPE_KEY}": "Plan" (from plan_to_json)')
    try:
        plan = _Reader().value(body, "plan")
    except RecursionError:
        raise ValueError("plan_from_json: the plan is nested too deeply to be one") from None
    assert isinstance(plan, Plan)  # a "Plan" record builds a Plan
    return plan
