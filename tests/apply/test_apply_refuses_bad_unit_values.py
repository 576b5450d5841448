"""``apply_plan`` refuses a plan whose units hold values of the wrong kind
(built by hand, or edited in code after planning) before anything is
sharded: a policy dtype given as a string (``param_dtype="bf16"``) would
reach ``fully_shard`` and fail, or cast to something else, long after the
first units were sharded."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx.plan._plan import Plan
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh
from unchanged import assert_unchanged, state_of

CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2)


def planned(model: Decoder) -> Plan:
    return fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))


BAD_UNITS: dict[str, tuple[dict[str, Any], str]] = {
    "param_dtype-string": (
        {"mp_policy": MixedPrecisionPolicy(param_dtype="bf16")},  # type: ignore[arg-type]
        r"unit 0: mp_policy\.param_dtype must be a floating dtype .* got 'bf16'",
    ),
    "reduce_dtype-integer": (
        {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.int32)},
        r"unit 0: mp_policy\.reduce_dtype must be a floating dtype .* got torch\.int32",
    ),
    "cast_forward_inputs-string": (
        {"mp_policy": MixedPrecisionPolicy(cast_forward_inputs="no")},  # type: ignore[arg-type]
        r"unit 0: mp_policy\.cast_forward_inputs must be a bool, got 'no'",
    ),
    "storage_dtype-string": ({"storage_dtype": "bf16"}, r"unit 0: storage_dtype 'bf16' is not a torch dtype or None"),
    "kind-unknown": ({"kind": "bogus"}, r"unit 0: kind 'bogus' is not one of cross-block, dtype, block, expert, root"),
}


@pytest.mark.parametrize("case", sorted(BAD_UNITS))
def test_a_unit_value_of_the_wrong_kind_is_refused_before_anything_is_sharded(case: str) -> None:
    changes, message = BAD_UNITS[case]
    model = Decoder(CFG)
    p = planned(model)
    bad = p.replace(units=tuple(dataclasses.replace(u, **changes) for u in p.units))
    calls: list[object] = []
    before = state_of(model)
    with fake_mesh((2,), ("dp",)) as mesh:
        with pytest.raises(fsdptx.PlanMismatchError, match=message):
            fsdptx.apply_plan(bad, model, mesh, shard_module=lambda module, **kw: calls.append(module))
    assert calls == []
    assert_unchanged(before, state_of(model))


def test_the_same_plan_with_good_values_applies() -> None:
    """The refusals above come from the changed values alone."""
    model = Decoder(CFG)
    calls: list[object] = []
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(planned(model), model, mesh, shard_module=lambda module, **kw: calls.append(module))
    assert len(calls) == len(planned(Decoder(CFG)).units)
