"""The seed-compatible imperative API: fully_shard_by_dtype,
fully_shard_across_blocks, configure_fsdp_unused_param_reduction and the
MTP/CP guards."""

from __future__ import annotations

import gc
import math
import sys
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import BF16, DIM, FP32, Block, CastLinear, Mlp, make_decoder, master_weights
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.compat import _imperative as imperative
from fsdptx.testing import fake_mesh, mark_sharded

BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=BF16)
MESH = object()  # the recording primitive never looks at the mesh


class RecordingPrimitive:
    """Stands in for ``fully_shard``: records ``(modules, kwargs)`` and does nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[nn.Module | list[nn.Module], dict[str, Any]]] = []

    def __call__(self, modules: nn.Module | list[nn.Module], **kwargs: Any) -> None:
        self.calls.append((modules, kwargs))

    def targets(self) -> list[nn.Module | list[nn.Module]]:
        return [m for m, _ in self.calls]


def by_dtype(
    module: nn.Module,
    mp_policy: MixedPrecisionPolicy | None = None,
    fp32_names: tuple[str, ...] = (),
    reshard: bool | int | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> RecordingPrimitive:
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(
        module, MESH, mp_policy, None, fp32_names, reshard, ignored, shard_module=prim  # type: ignore[arg-type]
    )
    return prim


class FP32Scaled(nn.Module):
    """A block whose own fp32 ``scale`` sits beside bf16 submodules, and whose
    mlp holds an fp32 ``shift`` directly beside bf16 linears."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = Mlp()
        self.proj = CastLinear(DIM, DIM, BF16)
        self.scale = nn.Parameter(torch.ones(DIM, dtype=FP32))
        self.mlp.shift = nn.Parameter(torch.zeros(DIM, dtype=FP32))


class ForgetGate(nn.Module):
    """Kimi-Linear style: fp32 ``dt_bias`` and bf16 ``A_log`` directly on one
    module beside bf16 projections; no unit can hold both."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = CastLinear(DIM, DIM, BF16)
        self.dt_bias = nn.Parameter(torch.zeros(DIM, dtype=FP32))
        self.A_log = nn.Parameter(torch.zeros(DIM, dtype=BF16))


# --------------------------------------------------------------------------- fully_shard_by_dtype


def test_by_dtype_one_group_shards_the_module_once() -> None:
    mlp = Mlp()
    prim = by_dtype(mlp, BF16_POLICY)
    assert prim.targets() == [mlp]
    assert prim.calls[0][1]["mp_policy"] == BF16_POLICY


def test_by_dtype_two_groups_shard_minority_subtrees_then_the_module() -> None:
    block = Block()
    prim = by_dtype(block)
    assert prim.targets() == [block.attn.sinks, block.gate, block]


def test_by_dtype_two_groups_give_children_internal_policy_and_module_the_callers() -> None:
    # Without pinning, and recorded as computing in bf16, sinks and gate are
    # fp32 master weights (unrecorded, in this bf16-bulk block they would
    # be intrinsically fp32).
    block = master_weights(Block(), "sinks.weight", "gate.proj.weight")
    prim = by_dtype(block, BF16_POLICY)
    policies = [kw["mp_policy"] for _, kw in prim.calls]
    assert prim.targets() == [block.attn.sinks, block.gate, block]
    assert [p.output_dtype for p in policies] == [None, None, BF16]
    assert {p.param_dtype for p in policies} == {BF16}


def test_by_dtype_three_groups_shard_every_maximal_uniform_subtree() -> None:
    block = master_weights(Block(), "gate.proj.weight")
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",))
    assert prim.targets() == [block.attn.o, block.attn.q, block.attn.sinks, block.gate, block.mlp]  # FQN order


def test_by_dtype_pinned_fp32_unit_reduces_in_fp32_without_casting_inputs() -> None:
    block = Block()
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",))
    (sinks_kwargs,) = [kw for m, kw in prim.calls if m is block.attn.sinks]
    assert sinks_kwargs["mp_policy"] == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_by_dtype_does_not_pass_reshard_after_forward_none() -> None:
    prim = by_dtype(Block())
    assert all("reshard_after_forward" not in kw for _, kw in prim.calls)


def test_by_dtype_passes_explicit_reshard_after_forward_to_every_unit() -> None:
    prim = by_dtype(Block(), reshard=False)
    assert [kw["reshard_after_forward"] for _, kw in prim.calls] == [False, False, False]


def test_by_dtype_forwards_ignored_params_only_to_units_containing_them() -> None:
    block = Block()
    prim = by_dtype(block, ignored={block.gate.proj.weight})
    with_ignored = [(m, kw["ignored_params"]) for m, kw in prim.calls if "ignored_params" in kw]
    assert prim.targets() == [block.attn.sinks, block]
    assert with_ignored == [(block, {block.gate.proj.weight})]


def test_by_dtype_keeps_the_module_as_a_unit_when_only_it_can_hold_ignored_params() -> None:
    block = Block()
    prim = by_dtype(block, BF16_POLICY, fp32_names=("sinks",), ignored={block.attn.q.weight})
    assert prim.targets()[-1] is block
    assert prim.calls[-1][1]["ignored_params"] == {block.attn.q.weight}


def test_by_dtype_ignores_ignored_params_from_outside_the_module() -> None:
    mlp, stranger = Mlp(), nn.Parameter(torch.zeros(2))
    prim = by_dtype(mlp, ignored={stranger})
    assert prim.targets() == [mlp] and "ignored_params" not in prim.calls[0][1]


def test_by_dtype_shards_children_before_modules_holding_the_minority_directly() -> None:
    block = FP32Scaled()
    prim = by_dtype(block)
    assert prim.targets() == [[block.mlp.down, block.mlp.up], block.mlp, block.proj, block]


def test_by_dtype_with_real_fully_shard_gives_direct_holders_units_of_their_own() -> None:
    block = FP32Scaled()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, None, None)
        shift_group = fully_shard.state(block.mlp)._fsdp_param_group  # type: ignore[attr-defined]
        owned = [fp.sharded_param for fp in shift_group.fsdp_params]
    assert len(owned) == 1 and owned[0] is block.mlp.shift
    assert all(isinstance(p, DTensor) for p in block.parameters())


def test_by_dtype_raises_naming_every_directly_mixed_param_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError) as info:
        fsdptx.fully_shard_by_dtype(ForgetGate(), MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    message = str(info.value)
    assert "dt_bias (float32->float32)" in message and "A_log (bfloat16->bfloat16)" in message
    assert "ignored_params" not in message
    assert prim.calls == []


def test_by_dtype_with_real_fully_shard_makes_each_unit_an_fsdp_module() -> None:
    block = master_weights(Block(), "gate.proj.weight")
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, BF16_POLICY, None, ("sinks",))
        sharded = {f for f, m in block.named_modules() if isinstance(m, FSDPModule)}
    assert sharded == {"attn.q", "attn.o", "attn.sinks", "mlp", "gate"}
    assert all(isinstance(p, DTensor) for p in block.parameters())


# --------------------------------------------------------------------------- fully_shard_across_blocks


def test_across_blocks_makes_one_call_with_every_blocks_holder() -> None:
    blocks = [Block() for _ in range(3)]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], MESH, BF16_POLICY, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks]]


def test_across_blocks_unit_is_fp32_internal_and_not_resharded() -> None:
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks([Block(), Block()], ["attn.sinks"], MESH, BF16_POLICY, None, shard_module=prim)  # type: ignore[arg-type]
    kwargs = prim.calls[0][1]
    assert kwargs["reshard_after_forward"] is False
    assert kwargs["mp_policy"] == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_across_blocks_makes_one_call_per_name() -> None:
    blocks = [Block(), Block()]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks", "gate"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks], [b.gate for b in blocks]]


def test_across_blocks_looks_through_checkpoint_wrappers() -> None:
    blocks = [Block(), Block()]
    wrapped = [checkpoint_wrapper(b) for b in blocks]
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(wrapped, ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert prim.targets() == [[b.attn.sinks for b in blocks]]


def test_across_blocks_does_not_reparent_the_blocks() -> None:
    model = make_decoder()
    prim = RecordingPrimitive()
    fsdptx.fully_shard_across_blocks(list(model.layers), ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert [f for f, _ in model.named_modules()] == [f for f, _ in make_decoder().named_modules()]


def test_across_blocks_returns_the_dtensor_params_now_owned() -> None:
    blocks = [Block(), Block()]
    with fake_mesh((2,), ("dp",)) as mesh:
        owned = fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], mesh, None, None)
    current = [b.attn.sinks.weight for b in blocks]
    assert len(owned) == 2 and all(any(o is c for c in current) for o in owned)
    assert all(isinstance(p, DTensor) and isinstance(p, nn.Parameter) for p in owned)


def test_across_blocks_params_serve_as_ignored_params_of_enclosing_units() -> None:
    blocks = [Block(), Block()]
    with fake_mesh((2,), ("dp",)) as mesh:
        owned = fsdptx.fully_shard_across_blocks(blocks, ["attn.sinks"], mesh, None, None)
        for b in blocks:
            fsdptx.fully_shard_by_dtype(b, mesh, None, None, ignored_params=owned)
        groups = {id(fully_shard.state(b.attn.sinks)._fsdp_param_group) for b in blocks}
    assert len(groups) == 1 and all(isinstance(b, FSDPModule) for b in blocks)


def test_across_blocks_non_fp32_holder_raises_naming_the_params_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError, match=r"'mlp'.*0\.mlp\.up\.weight is bfloat16") as info:
        fsdptx.fully_shard_across_blocks([Block(), Block()], ["mlp"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert "1.mlp.down.weight is bfloat16" in str(info.value)
    assert prim.calls == []


def test_across_blocks_unknown_name_raises_naming_it_before_any_call() -> None:
    prim = RecordingPrimitive()
    with pytest.raises(ValueError, match=r"'attn\.sink'"):
        fsdptx.fully_shard_across_blocks(
            [Block(), Block()], ["attn.sinks", "attn.sink"], MESH, None, None, shard_module=prim  # type: ignore[arg-type]
        )
    assert prim.calls == []


# --------------------------------------------------------------------------- configure_fsdp_unused_param_reduction


def test_unused_param_reduction_counts_a_multi_module_unit_once() -> None:
    model = make_decoder(3)
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks)
    with fake_mesh((2,), ("dp",)) as mesh:
        p = fsdptx.plan(model, pipeline)
        fsdptx.apply_plan(p, model, mesh)
        count = fsdptx.configure_fsdp_unused_param_reduction(model)
    assert count == len(p.units) == 8  # cross-block, 3 x (gate, block), root


def test_unused_param_reduction_sets_the_fsdp_flag_on_every_unit() -> None:
    model = make_decoder()
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks)
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(fsdptx.plan(model, pipeline), model, mesh)
        groups = {
            id(g): g
            for m in model.modules()
            if isinstance(m, FSDPModule)
            for g in [fully_shard.state(m)._fsdp_param_group]
        }
        before = {g.reduce_scatter_unused_params for g in groups.values()}
        fsdptx.configure_fsdp_unused_param_reduction(model)
        after = {g.reduce_scatter_unused_params for g in groups.values()}
    assert (before, after) == ({False}, {True})


def test_unused_param_reduction_on_unsharded_model_returns_zero() -> None:
    assert fsdptx.configure_fsdp_unused_param_reduction(make_decoder()) == 0


def test_unused_param_reduction_covers_only_the_given_subtree() -> None:
    model = make_decoder()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.apply_plan(fsdptx.plan(model, fsdptx.shard_by_dtype), model, mesh)
        count = fsdptx.configure_fsdp_unused_param_reduction(model.layers[0])
        root_flag = fully_shard.state(model)._fsdp_param_group.reduce_scatter_unused_params
    assert (count, root_flag) == (3, False)  # sinks, gate, block


# --------------------------------------------------------------------------- MTP / CP guards


class WithSupports(nn.Module):
    def __init__(self, **flags: bool) -> None:
        super().__init__()
        self.supports = SimpleNamespace(**flags)


def test_mtp_cp_rejects_enabled_mtp_without_cp_support() -> None:
    with pytest.raises(ValueError, match="WithSupports.*supports_mtp_cp"):
        fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=True, supports_mtp_cp=False))


def test_mtp_cp_accepts_enabled_mtp_with_cp_support() -> None:
    fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=True, supports_mtp_cp=True))


def test_mtp_cp_accepts_disabled_mtp() -> None:
    fsdptx.reject_unsupported_mtp_cp(WithSupports(mtp_enabled=False))


def test_mtp_cp_accepts_model_without_supports() -> None:
    fsdptx.reject_unsupported_mtp_cp(make_decoder())


def test_mtp_cp_pp_rejects_pipeline_without_cp_pp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    with pytest.raises(ValueError, match=r"pp_size=2.*supports_mtp_cp_pp"):
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)


def test_mtp_cp_pp_accepts_pipeline_with_cp_pp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=True)
    fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=4)


@pytest.mark.parametrize("pp_size", [None, 1])
def test_mtp_cp_pp_without_pipeline_needs_only_cp_support(pp_size: int | None) -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=True, supports_mtp_cp_pp=False)
    fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=pp_size)


def test_mtp_cp_pp_still_rejects_missing_cp_support() -> None:
    model = WithSupports(mtp_enabled=True, supports_mtp_cp=False, supports_mtp_cp_pp=True)
    with pytest.raises(ValueError, match="supports_mtp_cp;"):
        fsdptx.reject_unsupported_mtp_cp_pp(model, pp_size=2)


def test_mtp_cp_pp_accepts_model_without_supports() -> None:
    fsdptx.reject_unsupported_mtp_cp_pp(make_decoder(), pp_size=8)


def test_by_dtype_on_a_module_already_sharded_is_refused_naming_it() -> None:
    block = Block()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.fully_shard_by_dtype(block, mesh, None, None)
        with pytest.raises(ValueError, match="target '<root>' is already an FSDP module"):
            fsdptx.fully_shard_by_dtype(block, mesh, None, None)


# --------------------------------------------------------------------------- ParameterSet


class _NoScan(fsdptx.ParameterSet):
    """A ParameterSet that fails if anything iterates over it."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("the ParameterSet was scanned")


def test_a_parameter_set_is_looked_up_not_scanned() -> None:
    model = make_decoder()
    sinks = _NoScan([model.layers[0].attn.sinks.weight])
    prim = RecordingPrimitive()
    fsdptx.fully_shard_by_dtype(model.layers[0], MESH, BF16_POLICY, None, ignored_params=sinks, shard_module=prim)  # type: ignore[arg-type]
    assert any(kw.get("ignored_params") == {model.layers[0].attn.sinks.weight} for _m, kw in prim.calls)


def test_a_parameter_set_refuses_a_name_when_built() -> None:
    with pytest.raises(TypeError, match="'attn.sinks.weight'"):
        fsdptx.ParameterSet(["attn.sinks.weight"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    "add",
    [
        lambda s: s.add("w"),
        lambda s: s.update(["w"]),
        lambda s: s.__ior__({"w"}),
        lambda s: s.symmetric_difference_update({"w"}),
        lambda s: s.__ixor__({"w"}),
    ],
    ids=["add", "update", "ior", "symmetric_difference_update", "ixor"],
)
def test_a_parameter_set_refuses_a_name_added_later(add: Any) -> None:
    s = fsdptx.ParameterSet()
    with pytest.raises(TypeError, match="'w'"):
        add(s)
    assert len(s) == 0


def test_a_plain_set_holding_a_name_is_still_refused() -> None:
    model = make_decoder()
    with pytest.raises(TypeError, match="'attn.sinks.weight'"):
        fsdptx.fully_shard_by_dtype(
            model.layers[0], MESH, BF16_POLICY, None, ignored_params={"attn.sinks.weight"}, shard_module=RecordingPrimitive()  # type: ignore[arg-type]
        )


def test_across_blocks_returns_a_parameter_set() -> None:
    model = make_decoder()
    prim = RecordingPrimitive()
    owned = fsdptx.fully_shard_across_blocks(list(model.layers), ["attn.sinks"], MESH, None, None, shard_module=prim)  # type: ignore[arg-type]
    assert isinstance(owned, fsdptx.ParameterSet) and isinstance(owned, set)
    assert owned == {b.attn.sinks.weight for b in model.layers}


# --------------------------------------------------------------------------- units remembered across calls


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> imperative._CallMemo:
    """A memo of this test's own, so earlier tests' calls do not count."""
    fresh = imperative._CallMemo(limit=64)
    monkeypatch.setattr(imperative, "_CALLS", fresh)
    return fresh


def _planned_in_full(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The modules whose calls are planned (not taken from the memo) from here on."""
    planned: list[nn.Module] = []
    original = imperative.resolve_units

    def counting(model: nn.Module, **kwargs: Any) -> Any:
        planned.append(model)
        return original(model, **kwargs)

    monkeypatch.setattr(imperative, "resolve_units", counting)
    return planned


def _call(
    block: nn.Module,
    memo: imperative._CallMemo | None,
    *,
    mp_policy: MixedPrecisionPolicy | None = BF16_POLICY,
    offload_policy: OffloadPolicy | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> tuple[Any, ...]:
    units, _modules = imperative._plan_call(block, imperative._Call(mp_policy, offload_policy, (), None), ignored, memo)
    return units


def test_only_the_first_of_blocks_built_alike_is_planned(
    calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(3)
    planned = _planned_in_full(monkeypatch)
    for block in model.layers:
        fsdptx.fully_shard_by_dtype(block, MESH, BF16_POLICY, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    assert planned == [model.layers[0]]


def test_a_remembered_call_gives_the_units_and_modules_planning_gives(calls: imperative._CallMemo) -> None:
    model = make_decoder(2)
    _call(model.layers[0], calls)
    block = model.layers[1]
    call = imperative._Call(BF16_POLICY, None, (), None)
    remembered = imperative._plan_call(block, call, None, calls)
    planned = imperative._plan_call(block, call, None, None)
    assert remembered[0] == planned[0]
    assert [[id(m) for m in ms] for ms in remembered[1]] == [[id(m) for m in ms] for ms in planned[1]]


def test_sharding_a_block_the_memo_knows_calls_the_primitive_on_that_blocks_modules(
    calls: imperative._CallMemo,
) -> None:
    model = make_decoder(2)
    by_dtype(model.layers[0], BF16_POLICY)
    second = by_dtype(model.layers[1], BF16_POLICY)
    inside = {id(m) for m in model.layers[1].modules()}
    assert second.calls and all(
        id(m) in inside for target in second.targets() for m in (target if isinstance(target, list) else [target])
    )


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda b: b.attn.q.weight.requires_grad_(False), id="a frozen parameter"),
        pytest.param(lambda b: b.mlp.to(torch.float32), id="a cast"),
        pytest.param(lambda b: setattr(b.attn.q.weight, "_hf_compute_dtype", FP32), id="a compute-dtype hint"),
        pytest.param(lambda b: b.mlp.add_module("extra", CastLinear(DIM, DIM, BF16)), id="an added module"),
    ],
)
def test_a_block_that_differs_from_the_remembered_one_is_planned(
    calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    model = make_decoder(2)
    _call(model.layers[0], calls)
    change(model.layers[1])
    planned = _planned_in_full(monkeypatch)
    assert _call(model.layers[1], calls) == _call(model.layers[1], None)
    assert planned[0] is model.layers[1]


def test_a_call_ignoring_other_parameters_is_planned(calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_decoder(2)
    _call(model.layers[0], calls)
    planned = _planned_in_full(monkeypatch)
    ignored = {model.layers[1].attn.sinks.weight}
    assert _call(model.layers[1], calls, ignored=ignored) == _call(model.layers[1], None, ignored=ignored)
    assert planned[0] is model.layers[1]


def test_a_call_with_another_mixed_precision_policy_is_planned(
    calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(2)
    other = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    _call(model.layers[0], calls)
    planned = _planned_in_full(monkeypatch)
    assert _call(model.layers[1], calls, mp_policy=other) == _call(model.layers[1], None, mp_policy=other)
    assert planned[0] is model.layers[1]


def test_an_offload_policy_that_is_no_policy_is_refused_as_without_the_memo(calls: imperative._CallMemo) -> None:
    model = make_decoder(2)
    by_dtype(model.layers[0], BF16_POLICY)
    with pytest.raises(fsdptx.PlanMismatchError, match="offload_policy <class .*CPUOffloadPolicy.*> is not an OffloadPolicy"):
        fsdptx.fully_shard_by_dtype(
            model.layers[1], MESH, BF16_POLICY, CPUOffloadPolicy, shard_module=RecordingPrimitive()  # type: ignore[arg-type]
        )


def test_remembered_units_carry_this_calls_offload_policy_object(calls: imperative._CallMemo) -> None:
    """An offload policy is a mutable dataclass: the one a call was given is
    the one its units hand the primitive, even when an equal one was
    remembered."""
    model = make_decoder(2)
    first, second = CPUOffloadPolicy(), CPUOffloadPolicy()
    _call(model.layers[0], calls, offload_policy=first)
    units = _call(model.layers[1], calls, offload_policy=second)
    assert units and all(u.offload_policy is second for u in units)


def test_remembered_units_carry_this_calls_reshard_value() -> None:
    """``0.0 == -0.0``: planning hands every unit the value the call gave,
    and so does the memo (an invalid value is then named as given)."""
    memo = imperative._CallMemo(limit=4)
    model = make_decoder(2)
    imperative._plan_call(model.layers[0], imperative._Call(BF16_POLICY, None, (), 0.0), None, memo)  # type: ignore[arg-type]
    units, _ = imperative._plan_call(model.layers[1], imperative._Call(BF16_POLICY, None, (), -0.0), None, memo)  # type: ignore[arg-type]
    assert len(memo) == 1 and units
    assert all(math.copysign(1.0, u.reshard_after_forward) == -1.0 for u in units)  # type: ignore[arg-type]


class _Stack(nn.ModuleList):
    """A ModuleList subclass: a bare container until something gives it a forward."""


def _stacked_block() -> nn.Module:
    block = nn.Module()
    block.norm = CastLinear(DIM, DIM, BF16)
    block.stack = _Stack([CastLinear(DIM, DIM, FP32) for _ in range(2)])
    block.out = CastLinear(DIM, 4 * DIM, BF16)
    block.extra = CastLinear(DIM, DIM, BF16)  # bf16 the majority: the fp32 stack is isolated
    return block


def test_a_container_class_given_a_forward_after_a_call_is_planned_anew(
    calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a ModuleList class is a bare container depends on its
    ``forward``, which a patch may add between two calls."""
    _call(_stacked_block(), calls)
    monkeypatch.setattr(_Stack, "forward", lambda self, x: x, raising=False)
    block = _stacked_block()
    planned = _planned_in_full(monkeypatch)
    assert _call(block, calls) == _call(block, None)
    assert planned[0] is block


def test_a_block_holding_a_tied_parameter_is_always_planned(
    calls: imperative._CallMemo, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_decoder(2)
    for block in model.layers:
        block.mlp.up.weight = block.mlp.down.weight
    planned = _planned_in_full(monkeypatch)
    _call(model.layers[0], calls)
    _call(model.layers[1], calls)
    assert planned == list(model.layers) and len(calls) == 0


def test_the_memo_keeps_no_model_alive(calls: imperative._CallMemo) -> None:
    model = make_decoder(2)
    for block in model.layers:
        fsdptx.fully_shard_by_dtype(block, MESH, BF16_POLICY, None, shard_module=mark_sharded)  # type: ignore[arg-type]
    assert len(calls) == 1
    gone = weakref.ref(model)
    del model, block
    gc.collect()
    assert gone() is None


def test_the_memo_keeps_the_most_recently_used_calls() -> None:
    memo = imperative._CallMemo(limit=2)
    entry = imperative._Planned((), ())
    memo.put(("a",), entry)
    memo.put(("b",), entry)
    assert memo.get(("a",)) is entry  # a hit counts as a use
    memo.put(("c",), entry)
    assert memo.get(("b",)) is None
    assert memo.get(("a",)) is entry and memo.get(("c",)) is entry


def test_reshard_after_forward_one_is_not_taken_for_true(calls: imperative._CallMemo) -> None:
    """``True == 1`` in Python, but an int asks FSDP to reshard to that many
    ranks: a call with one must not get units recorded for the other."""
    model = make_decoder(2)
    recorded, _ = imperative._plan_call(model.layers[0], imperative._Call(BF16_POLICY, None, (), True), None, calls)
    units, _ = imperative._plan_call(model.layers[1], imperative._Call(BF16_POLICY, None, (), 1), None, calls)
    assert {u.reshard_after_forward for u in recorded} == {True}
    assert {type(u.reshard_after_forward) for u in units} == {int}


def test_the_memo_serves_calls_from_several_threads() -> None:
    """Lookups reorder the entries and stores evict them: from several
    threads at once, neither may fail the other. Threads switch every
    microsecond here, so a lookup meets an eviction within the run."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    memo = imperative._CallMemo(limit=1)  # every store evicts what a lookup just found
    entry = imperative._Planned((), ())
    errors: list[BaseException] = []

    def hammer(offset: int) -> None:
        try:
            for i in range(3000):
                memo.put((offset + i % 2,), entry)
                memo.get((offset + i % 2,))
        except BaseException as e:  # noqa: BLE001 (any failure fails the test)
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(previous)
    assert errors == [] and len(memo) <= 1
