"""Any edit of a plan file either reads back as a plan that behaves like one
(it prints, diffs, and survives another trip through JSON) or is refused
with a ``ValueError``: never a ``KeyError``, ``TypeError`` or
``AttributeError`` from deep inside, and never a plan that fails later."""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdptx
from fsdptx.plan._json import plan_from_document
from fsdptx.plan._plan import Plan
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def original() -> tuple[Plan, str]:
    with torch.device("meta"):
        model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2, fp32_holders=True))
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        config = fsdptx.FSDP2Config(sequence_parallel=True, activation_checkpointing="full", enable_fsdp2_prefetch=True)
        p = fsdptx.FSDP2Manager(config, mesh).plan(model)
    return p, fsdptx.plan_to_json(p)


def paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            found += paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += paths(v, (*at, i))
    return found


KINDS = ["dtype", "Shard", "Replicate", "Partial", "ParallelStyle", "Unit", "Plan", "mapping", "MixedPrecisionPolicy", "TPAssignment"]
leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False), st.sampled_from(["", "bf16", "mean"]))
values = st.recursive(
    st.one_of(leaves, st.builds(lambda k: {"__type__": k}, st.sampled_from(KINDS))),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(["__type__", "name", "dim", "items", "attributes", "a"]), inner, max_size=3),
    ),
    max_leaves=6,
)


@st.composite
def edited(draw: st.DrawFn) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(original()[1])
    spots = paths(data)[1:]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(spots))
        target: Any = data
        try:
            for key in where[:-1]:
                target = target[key]
            if draw(st.booleans()) and isinstance(target, dict):
                target.pop(where[-1], None)
            else:
                target[where[-1]] = draw(values)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed the way there
            continue
    return data


@SETTINGS
@given(edited())
def test_an_edited_plan_file_is_refused_with_a_value_error_or_reads_as_a_working_plan(data: dict[str, Any]) -> None:
    try:
        p = plan_from_document(data)
    except ValueError:
        return
    text = fsdptx.plan_to_json(p)
    assert fsdptx.plan_from_json(text) == p
    str(p)
    fsdptx.diff_plans(original()[0], p)
