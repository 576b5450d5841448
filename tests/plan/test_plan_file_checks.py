"""A plan file is data anyone can edit: reading one checks every field
against what its record holds, and refuses the first that does not fit
with a ``ValueError`` naming the field's path and what it must be, before
anything is built. What a plan can hold (a root parameter named
``__type__``) reads back as written."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fsdptx
from fsdptx.plan._plan import Plan
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2, fp32_holders=True)


@functools.cache
def document() -> str:
    """A plan with units, policies, TP styles, the stream, checkpointing
    and reduction marks, as plan_to_json writes it."""
    with torch.device("meta"):
        model = Decoder(CFG)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        config = fsdptx.FSDP2Config(sequence_parallel=True, activation_checkpointing="full")
        return fsdptx.plan_to_json(fsdptx.FSDP2Manager(config, mesh).plan(model))


def tampered(change: Callable[[dict[str, Any]], None]) -> str:
    data = json.loads(document())
    change(data)
    return json.dumps(data)


def _unit(data: dict[str, Any]) -> dict[str, Any]:
    unit: dict[str, Any] = data["plan"]["units"][0]
    return unit


def _style(data: dict[str, Any], module: str) -> dict[str, Any]:
    found = next(a for a in data["plan"]["tensor_parallel"]["assignments"] if a["module"] == module)
    style: dict[str, Any] = found["parallel_style"]
    return style


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = data
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value

    return change


TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "unit-kind": (_set("plan.units.0.kind", "bogus"), r"plan\.units\[0\]\.kind must be one of 'cross-block', .*, but is the string 'bogus'"),
    "params-as-a-string": (_set("plan.units.0.params", "layers.0.sinks.weight"), r"plan\.units\[0\]\.params must be a list, each item a string, but is the string"),
    "one-param-a-number": (lambda d: _unit(d)["params"].append(3), r"plan\.units\[0\]\.params\[\d+\] must be a string, but is the number 3"),
    "storage-dtype-string": (_set("plan.units.0.storage_dtype", "bf16"), r"plan\.units\[0\]\.storage_dtype must be a dtype .* or null, but is the string 'bf16'"),
    "policy-dtype-string": (_set("plan.units.0.mp_policy.param_dtype", "bf16"), r"plan\.units\[0\]\.mp_policy\.param_dtype must be a dtype .* or null, but is the string 'bf16'"),
    "policy-as-a-string": (_set("plan.mp_policy", "bf16"), r"plan\.mp_policy must be a MixedPrecisionPolicy .* or null, but is the string 'bf16'"),
    "offload-policy-as-a-policy": (_set("plan.units.0.offload_policy", {"__type__": "MixedPrecisionPolicy"}), r"plan\.units\[0\]\.offload_policy must be an OffloadPolicy"),
    "unknown-checkpoint-mode": (_set("plan.checkpointing.mode", "everything"), r"plan\.checkpointing\.mode must be one of 'full', 'selective', but is the string 'everything'"),
    "schema-true": (_set("schema", True), r"schema true is not supported"),
    "schema-string": (_set("schema", "1"), r'schema "1" is not supported'),
    "numel-a-float": (_set("plan.units.0.numel", 1.5), r"plan\.units\[0\]\.numel must be an integer, but is the number 1\.5"),
    "numel-a-bool": (_set("plan.units.0.numel", True), r"plan\.units\[0\]\.numel must be an integer, but is true"),
    "nbytes-negative": (_set("plan.units.0.nbytes", -1), r"plan\.units\[0\]\.nbytes: must not be negative, but is -1"),
    "reduction-unknown": (lambda d: d["plan"]["reductions"].__setitem__("layers.0.attn_norm.weight", "max"), r"plan\.reductions\['layers\.0\.attn_norm\.weight'\] must be one of 'mean', 'sum', but is the string 'max'"),
    "reshard-a-string": (_set("plan.units.0.reshard_after_forward", "yes"), r"plan\.units\[0\]\.reshard_after_forward must be true or false or an integer or null"),
    "sequence-parallel-a-string": (_set("plan.tensor_parallel.sequence_parallel", "yes"), r"plan\.tensor_parallel\.sequence_parallel must be true or false"),
    "dtype-unknown": (_set("plan.units.0.storage_dtype", {"__type__": "dtype", "name": "Tensor"}), r"plan\.units\[0\]\.storage_dtype: unknown torch dtype \"Tensor\""),
    "dtype-without-name": (_set("plan.units.0.storage_dtype", {"__type__": "dtype"}), r"plan\.units\[0\]\.storage_dtype: a dtype needs the field\(s\) \['name'\]"),
    "type-not-a-string": (_set("plan.units.0.mp_policy", {"__type__": 3}), r'plan\.units\[0\]\.mp_policy: "__type__" must name a type'),
    "unknown-type": (_set("plan.units.0.mp_policy", {"__type__": "Policy"}), r"plan\.units\[0\]\.mp_policy has unknown type 'Policy'"),
    "unit-missing-fields": (_set("plan.units.0", {"__type__": "Unit"}), r"plan\.units\[0\]: a Unit needs the field\(s\) \['modules', 'params'"),
    "plan-not-a-plan": (_set("plan", {"__type__": "Unit"}), r'"plan" must be an object with "__type__": "Plan"'),
    "extra-top-level-key": (_set("notes", "hi"), r"the document has keys \['notes'\]"),
    "style-layout-not-a-placement": (
        lambda d: _style(d, "lm_head")["attributes"].__setitem__("input_layouts", ["Shard(1)"]),
        r"plan\.tensor_parallel\.assignments\[\d+\]\.parallel_style\.attributes\.input_layouts\[0\] must be a Placement",
    ),
    "style-flag-a-string": (
        lambda d: _style(d, "lm_head")["attributes"].__setitem__("use_local_output", "yes"),
        r"parallel_style\.attributes\.use_local_output must be true or false, but is the string 'yes'",
    ),
    "shard-without-dim": (
        lambda d: _style(d, "lm_head")["attributes"].__setitem__("input_layouts", [{"__type__": "Shard"}]),
        r"input_layouts\[0\]: a Shard needs the field\(s\) \['dim'\]",
    ),
    "shard-dim-a-bool": (
        lambda d: _style(d, "lm_head")["attributes"].__setitem__("input_layouts", [{"__type__": "Shard", "dim": True}]),
        r"input_layouts\[0\]\.dim: must be an integer, but is true",
    ),
    "style-without-attributes": (lambda d: _style(d, "lm_head").pop("attributes"), r"a ParallelStyle needs the field\(s\) \['attributes'\]"),
    "stream-step-role-a-number": (_set("plan.tensor_parallel.stream.0.role", 1), r"plan\.tensor_parallel\.stream\[0\]\.role must be a string, but is the number 1"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_plan_file_is_refused_naming_the_field_and_what_it_must_be(case: str) -> None:
    change, message = TAMPERED[case]
    with pytest.raises(ValueError, match=message):
        fsdptx.plan_from_json(tampered(change))


def test_the_untampered_file_reads_back() -> None:
    """The cases above change one thing each in a file that reads."""
    assert isinstance(fsdptx.plan_from_json(document()), Plan)


def test_json_nested_too_deeply_is_a_value_error_not_a_recursion_error() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        fsdptx.plan_from_json("[" * 100_000 + "]" * 100_000)
    deep = '{"schema": 1, "plan": {"__type__": "Plan", "warnings": ' + "[" * 5_000 + "]" * 5_000 + "}}"
    with pytest.raises(ValueError, match="nested too deeply"):
        fsdptx.plan_from_json(deep)


class RootTyped(nn.Module):
    """A model whose root holds a parameter named ``__type__`` (the key
    plan files use to mark an encoded object)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("__type__", nn.Parameter(torch.zeros(4)))
        self.inner = nn.Linear(4, 4)


def test_a_root_parameter_named_like_the_type_key_round_trips() -> None:
    p = fsdptx.plan(RootTyped(), fsdptx.shard_by_dtype).replace(reductions={"__type__": "sum", "inner.weight": "mean"})
    text = fsdptx.plan_to_json(p)
    back = fsdptx.plan_from_json(text)
    assert back == p
    assert dict(back.reductions) == {"__type__": "sum", "inner.weight": "mean"}
    assert json.loads(text)["plan"]["reductions"] == {
        "__type__": "mapping",
        "items": {"__type__": "sum", "inner.weight": "mean"},
    }


def test_a_plain_mapping_is_written_as_a_plain_object() -> None:
    p = fsdptx.plan(RootTyped(), fsdptx.shard_by_dtype).replace(reductions={"inner.weight": "sum"})
    assert json.loads(fsdptx.plan_to_json(p))["plan"]["reductions"] == {"inner.weight": "sum"}


def test_reading_a_document_never_edits_it() -> None:
    """Reading checks a document (a caller may show it afterwards)."""
    from fsdptx.plan._json import plan_from_document

    data = json.loads(tampered(_set("plan.units.0.kind", "bogus")))
    before = copy.deepcopy(data)
    with pytest.raises(ValueError):
        plan_from_document(data)
    assert data == before
    good = json.loads(document())
    plan_from_document(good)
    assert good == json.loads(document())
