"""apply_plan with a recording primitive: what it hands the primitive, the marks
it sets, and how it refuses a plan that does not fit the model."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
from models import BF16, DIM, FP32, CastLinear, make_decoder
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

import fsdptx
from fsdptx import Plan, PlanMismatchError
from fsdptx.tp._marks import is_excluded_from_tp_replica_sync, tp_replica_reduction
from fsdptx.testing import fake_mesh

BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
MESH = object()  # the recording primitive never looks at the mesh


class RecordingPrimitive:
    """Stands in for ``fully_shard``: records ``(modules, kwargs)`` per call and
    changes nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module | list[nn.Module], dict[str, Any]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: Any) -> None:
        self.calls.append((modules, kwargs))

    def modules(self) -> list[list[nn.Module]]:
        return [m if isinstance(m, list) else [m] for m, _ in self.calls]

    def kwargs_for(self, module: nn.Module) -> dict[str, Any]:
        found = [kw for m, kw in self.calls if m is module or (isinstance(m, list) and module in m)]
        assert len(found) == 1, f"{type(module).__name__} sharded {len(found)} times"
        return found[0]


def record(p: Plan, model: nn.Module) -> RecordingPrimitive:
    prim = RecordingPrimitive()
    fsdptx.apply_plan(p, model, MESH, shard_module=prim)  # type: ignore[arg-type]
    return prim


def refused(p: Plan, model: nn.Module) -> tuple[str, RecordingPrimitive]:
    """Apply a plan that must not fit; return the error message and the primitive."""
    prim = RecordingPrimitive()
    with pytest.raises(PlanMismatchError) as info:
        fsdptx.apply_plan(p, model, MESH, shard_module=prim)  # type: ignore[arg-type]
    return str(info.value), prim


def replace_unit(p: Plan, index: int, **changes: Any) -> Plan:
    units = list(p.units)
    units[index] = dataclasses.replace(units[index], **changes)
    return p.replace(units=tuple(units))


# --------------------------------------------------------------------------- calls


def test_apply_calls_primitive_once_per_unit_in_plan_order() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE, mp_policy=BF16_POLICY)
    prim = record(p, model)
    expected = [[model.get_submodule(f) for f in u.modules] for u in p.units]
    assert prim.modules() == expected


def test_apply_passes_a_list_for_a_multi_module_unit() -> None:
    model = make_decoder(3)
    prim = record(fsdptx.plan(model, PIPELINE), model)
    first, _ = prim.calls[0]
    assert isinstance(first, list) and first == [b.attn.sinks for b in model.layers]


def test_apply_passes_a_single_module_for_a_one_module_unit() -> None:
    model = make_decoder()
    prim = record(fsdptx.plan(model, PIPELINE), model)
    assert prim.calls[-1][0] is model


def test_apply_passes_mesh_and_unit_policy() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE, mp_policy=BF16_POLICY)
    prim = record(p, model)
    assert [kw["mesh"] for _, kw in prim.calls] == [MESH] * len(p.units)
    assert [kw["mp_policy"] for _, kw in prim.calls] == [u.mp_policy for u in p.units]


def test_apply_does_not_pass_reshard_after_forward_none() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    prim = record(p, model)
    holders = {u.modules for u in p.units if u.reshard_after_forward is False}
    assert holders == {("layers.0.attn.sinks",), ("layers.1.attn.sinks",)}  # kept gathered on purpose
    passed = [kw.get("reshard_after_forward") for _, kw in prim.calls]
    assert passed.count(False) == len(holders) and all(v in (None, False) for v in passed)


def test_apply_passes_explicit_reshard_after_forward() -> None:
    model = make_decoder()
    prim = record(fsdptx.plan(model, PIPELINE, reshard_after_forward=True), model)
    assert [kw["reshard_after_forward"] for _, kw in prim.calls] == [False] + [True] * (len(prim.calls) - 1)


def test_apply_turns_mp_policy_none_into_default_policy() -> None:
    model = make_decoder()
    prim = record(fsdptx.plan(model, PIPELINE), model)
    assert [kw["mp_policy"] for _, kw in prim.calls] == [MixedPrecisionPolicy()] * len(prim.calls)


def test_apply_passes_offload_policy_only_when_set() -> None:
    model = make_decoder()
    without = record(fsdptx.plan(model, PIPELINE), model)
    offload = OffloadPolicy()
    with_offload = record(fsdptx.plan(model, PIPELINE, offload_policy=offload), model)
    assert all("offload_policy" not in kw for _, kw in without.calls)
    assert all(kw["offload_policy"] is offload for _, kw in with_offload.calls)


def test_apply_passes_ignored_params_only_to_units_containing_them() -> None:
    model = make_decoder()
    transform = functools.partial(fsdptx.shard_by_dtype, ignored_params=["layers.0.mlp.up.weight"])
    prim = record(fsdptx.plan(model, transform), model)
    with_ignored = [(m, kw["ignored_params"]) for m, kw in prim.calls if "ignored_params" in kw]
    assert with_ignored == [(model.layers[0], {model.layers[0].mlp.up.weight})]


def test_apply_returns_the_model() -> None:
    model = make_decoder()
    prim = RecordingPrimitive()
    assert fsdptx.apply_plan(fsdptx.plan(model, PIPELINE), model, MESH, shard_module=prim) is model  # type: ignore[arg-type]


# --------------------------------------------------------------------------- marks


def test_apply_sets_reduction_marks_on_owning_modules() -> None:
    model = make_decoder()
    record(fsdptx.plan(model, PIPELINE), model)
    assert tp_replica_reduction(model.layers[1].gate.proj, "weight") == "sum"
    assert tp_replica_reduction(model.norm, "weight") == "mean"
    assert tp_replica_reduction(model.norm, "bias") == "mean"


def test_apply_leaves_unmarked_parameters_at_mean() -> None:
    model = make_decoder()
    transform = functools.partial(fsdptx.mark_reduction, reductions={"head": "sum"})
    record(fsdptx.plan(model, transform), model)
    assert tp_replica_reduction(model.head, "weight") == "sum"
    assert tp_replica_reduction(model.layers[0].gate.proj, "weight") == "mean"


def test_apply_sets_exclusion_marks_only_on_excluded_modules() -> None:
    model = make_decoder()
    transform = functools.partial(fsdptx.mark_reduction, reductions={}, exclude=["layers.1.mlp"])
    record(fsdptx.plan(model, transform), model)
    flagged = [f for f, m in model.named_modules() if is_excluded_from_tp_replica_sync(m)]
    assert flagged == ["layers.1.mlp"]


# --------------------------------------------------------------------------- refusals


def test_plan_naming_missing_module_is_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    del model.layers[1].gate
    message, prim = refused(p, model)
    assert "'layers.1.gate' does not exist" in message
    assert prim.calls == []


def test_parameter_claimed_by_two_units_is_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    stolen = p.units[0].params  # the sinks weight of layers.0
    p = replace_unit(p, 2, params=p.units[2].params + stolen)
    message, prim = refused(p, model)
    assert "'layers.0.attn.sinks.weight' is claimed by units 0 and 2" in message
    assert prim.calls == []


def test_unit_on_already_sharded_module_is_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(p, model, mesh)
        prim = RecordingPrimitive()
        with pytest.raises(PlanMismatchError) as info:
            fsdptx.apply_plan(p, model, mesh, shard_module=prim)
    assert "'layers.0.gate' is already sharded" in str(info.value)
    assert prim.calls == []


def test_stale_plan_is_refused_naming_the_new_parameter() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.layers[0].mlp.extra = CastLinear(DIM, DIM, BF16)
    message, prim = refused(p, model)
    assert "would also claim ['layers.0.mlp.extra.weight']" in message
    assert prim.calls == []


def test_stale_plan_is_refused_naming_the_removed_parameter() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    model.layers[0].mlp.up = nn.Identity()
    message, prim = refused(p, model)
    assert "would not reach ['layers.0.mlp.up.weight']" in message
    assert prim.calls == []


def test_unit_mixing_storage_dtypes_is_refused_naming_its_params() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    # Drop layers.0's gate unit (index 1) and hand its weight to the block unit.
    block = p.units[2]
    units = list(p.units)
    units[2] = dataclasses.replace(block, params=block.params + p.units[1].params)
    del units[1]
    message, prim = refused(p.replace(units=tuple(units)), model)
    assert "(layers.0) mixes storage dtypes" in message
    assert "layers.0.gate.proj.weight: float32" in message and "layers.0.attn.q.weight: bfloat16" in message
    assert prim.calls == []


def test_refusal_lists_every_problem_at_once() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    p = replace_unit(p, 1, modules=("layers.0.nope",))
    p = replace_unit(p, 3, modules=("layers.1.nope",))
    message, prim = refused(p, model)
    assert "'layers.0.nope'" in message and "'layers.1.nope'" in message
    assert prim.calls == []


def test_refusal_leaves_marks_unset() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, PIPELINE)
    del model.layers[1].gate
    refused(p, model)
    assert not hasattr(model.norm, "_fsdptx_tp_replica_reductions")


def test_reduction_mark_for_missing_parameter_is_refused() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.mark_reduction)
    model.norm = nn.LayerNorm(DIM, elementwise_affine=False, dtype=BF16)
    message, prim = refused(p, model)
    assert "'norm.weight', which the model lacks" in message


def test_plan_from_one_model_applies_to_an_identical_model() -> None:
    source, target = make_decoder(), make_decoder(seed=1)
    p = fsdptx.plan(source, PIPELINE)
    prim = record(p, target)
    assert len(prim.calls) == len(p.units) and prim.calls[-1][0] is target


def test_reshard_world_size_not_dividing_the_mesh_is_refused_before_any_unit() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, reshard_after_forward=3))
    prim = RecordingPrimitive()
    with fake_mesh((4,), ("dp",)) as mesh, pytest.raises(PlanMismatchError) as info:
        fsdptx.apply_plan(p, model, mesh, shard_module=prim)
    assert "reshard_after_forward=3 does not divide the shard dimension of the mesh (4)" in str(info.value)
    assert prim.calls == []


def test_hand_built_unit_with_invalid_reshard_value_is_refused() -> None:
    model = make_decoder()
    p = replace_unit(fsdptx.plan(model, PIPELINE), 0, reshard_after_forward="yes")
    message, prim = refused(p, model)
    assert "unit 0: reshard_after_forward='yes' is not None, a bool or a positive int" in message
    assert prim.calls == []
