"""The pure transforms: what each plans, bare and configured, and how they fail.

Nothing here touches a process group: transforms only read the model.
"""

from __future__ import annotations

import functools
import itertools
import pickle
import re
from collections.abc import Iterable

import pytest
import torch
from models import BF16, DIM, FP32, CastLinear, TinyDecoder, make_decoder, master_weights
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx import Plan, PlanningError, Unit
from fsdptx.core._names import join_names
from fsdptx.presets import Decoder, DecoderConfig

BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
PIPELINE_PARTS = (fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)


# --------------------------------------------------------------------------- helpers


def param(*shape: int, dtype: torch.dtype = BF16) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype))


class Holder(nn.Module):
    """A leaf holding ``n`` parameters ``w0..w{n-1}`` of one dtype."""

    def __init__(self, dtype: torch.dtype, n: int = 1, numel: int = 2) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"w{i}", param(numel, dtype=dtype))


def tree(**children: nn.Module) -> nn.Module:
    """A plain module with the given children, in keyword order."""
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


def unit_for(p: Plan, module: str) -> Unit:
    """The unique unit whose modules include ``module``."""
    found = [u for u in p.units if module in u.modules]
    assert len(found) == 1, f"{module!r} is in {len(found)} units of\n{p}"
    return found[0]


def unit_modules(p: Plan) -> list[tuple[str, ...]]:
    return [u.modules for u in p.units]


def dtype_units_on(p: Plan, target: str) -> dict[str, Unit]:
    """Units of kind ``dtype`` inside ``target``, by their single module FQN."""
    return {u.modules[0]: u for u in p.units if u.kind == "dtype" and u.modules[0].startswith(target + ".")}


def all_param_fqns(model: nn.Module) -> set[str]:
    return {f for f, _ in model.named_parameters()}


def only(items: Iterable[Unit]) -> Unit:
    items = list(items)
    assert len(items) == 1, items
    return items[0]


# --------------------------------------------------------------------------- shard_by_dtype, bare


def test_shard_by_dtype_bare_targets_blocks_from_no_split_modules_then_root() -> None:
    p = fsdptx.plan(make_decoder(3), fsdptx.shard_by_dtype)
    assert [u.modules for u in p.units if u.kind == "block"] == [("layers.0",), ("layers.1",), ("layers.2",)]
    assert p.units[-1].kind == "root" and p.units[-1].modules == ("",)


def test_shard_by_dtype_bare_falls_back_to_largest_module_list_for_blocks() -> None:
    class Undeclared(TinyDecoder):
        _no_split_modules = None

    model = Undeclared(3)
    model.extras = nn.ModuleList([CastLinear(DIM, DIM, BF16)])  # smaller list: not the blocks
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert [u.modules for u in p.units if u.kind == "block"] == [("layers.0",), ("layers.1",), ("layers.2",)]


def test_shard_by_dtype_bare_pins_fp32_compute_from_keep_in_fp32_modules_strict() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    sinks = unit_for(p, "layers.0.attn.sinks")
    gate = unit_for(p, "layers.0.gate")
    assert (sinks.storage_dtype, sinks.compute_dtype) == (FP32, FP32)
    assert not any("intrinsic" in r for r in sinks.reasons)  # pinned, not decided by the bulk
    # Not pinned, but fp32 in a bf16-bulk model: intrinsic, computes in fp32.
    assert (gate.storage_dtype, gate.compute_dtype) == (FP32, FP32)
    assert "fp32: intrinsic, bfloat16 bulk" in gate.reasons


def test_shard_by_dtype_option_fp32_compute_module_names_overrides_model_declaration() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, fp32_compute_module_names=("gate",))
    p = fsdptx.plan(master_weights(make_decoder(), "sinks.weight", "gate.proj.weight"), transform, mp_policy=BF16_POLICY)
    assert unit_for(p, "layers.0.gate").compute_dtype == FP32
    assert unit_for(p, "layers.0.attn.sinks").compute_dtype == BF16


def test_shard_by_dtype_option_blocks_limits_block_units() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, blocks=["layers.1"])
    p = fsdptx.plan(make_decoder(), transform)
    assert [u.modules for u in p.units if u.kind == "block"] == [("layers.1",)]
    assert "layers.0.attn.q.weight" in p.units[-1].params  # the root took the unplanned block


def test_shard_by_dtype_reshard_after_forward_comes_from_plan_default() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.shard_by_dtype, reshard_after_forward=False)
    assert {u.reshard_after_forward for u in p.units} == {False}


def test_shard_by_dtype_option_reshard_after_forward_overrides_plan_default() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, reshard_after_forward=2)
    p = fsdptx.plan(make_decoder(), transform, reshard_after_forward=False)
    holders = [u for u in p.units if "gathered: holder may return its parameter" in u.reasons]
    assert holders and all(u.reshard_after_forward is False for u in holders)  # correctness beats the option
    assert {u.reshard_after_forward for u in p.units if u not in holders} == {2}


def test_shard_by_dtype_option_ignored_params_are_owned_by_no_unit() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, ignored_params=["layers.0.mlp.up.weight"])
    p = fsdptx.plan(make_decoder(), transform)
    assert "layers.0.mlp.up.weight" not in p.owned_params
    assert unit_for(p, "layers.0").ignored_params == ("layers.0.mlp.up.weight",)


def test_shard_by_dtype_gives_every_parameter_exactly_one_unit() -> None:
    model = make_decoder()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    owned = [f for u in p.units for f in u.params]
    assert sorted(owned) == sorted(all_param_fqns(model))


# --------------------------------------------------------------------------- dtype groups


def test_one_dtype_group_gives_the_target_one_unit() -> None:
    model = tree(blk=tree(a=Holder(BF16, 2), b=Holder(BF16, 1)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_modules(p) == [("blk",), ("",)]
    assert unit_for(p, "blk").params == ("blk.a.w0", "blk.a.w1", "blk.b.w0")


def test_two_dtype_groups_shard_minority_subtrees_then_target_with_majority() -> None:
    model = tree(blk=tree(a=Holder(BF16, 2), s=Holder(FP32, 1), b=Holder(BF16, 1), t=Holder(FP32, 1)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_modules(p) == [("blk.s",), ("blk.t",), ("blk",), ("",)]
    assert (unit_for(p, "blk").storage_dtype, unit_for(p, "blk.s").storage_dtype) == (BF16, FP32)


def test_two_dtype_groups_minority_is_fewest_parameters_not_fewest_elements() -> None:
    big_fp32 = Holder(FP32, 1, numel=1000)
    model = tree(blk=tree(a=Holder(BF16, 3, numel=1), big=big_fp32))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_modules(p)[:2] == [("blk.big",), ("blk",)]
    assert unit_for(p, "blk").storage_dtype == BF16


def test_two_dtype_groups_minority_may_be_the_low_precision_group() -> None:
    model = tree(blk=tree(a=Holder(FP32, 3), b=Holder(BF16, 1)))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_modules(p)[:2] == [("blk.b",), ("blk",)]
    assert unit_for(p, "blk").storage_dtype == FP32


def test_three_dtype_groups_shard_every_maximal_uniform_subtree() -> None:
    p = fsdptx.plan(
        master_weights(make_decoder(1), "gate.proj.weight"),
        functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0"]),
        mp_policy=BF16_POLICY,
    )
    # bf16 linears, fp32->fp32 sinks, fp32->bf16 gate: attn is mixed, mlp is uniform.
    assert sorted(dtype_units_on(p, "layers.0")) == [
        "layers.0.attn.o",
        "layers.0.attn.q",
        "layers.0.attn.sinks",
        "layers.0.gate",
        "layers.0.mlp",
    ]


def test_three_dtype_groups_give_the_block_no_unit_when_nothing_is_left_to_it() -> None:
    p = fsdptx.plan(master_weights(make_decoder(1), "gate.proj.weight"), fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    assert [u for u in p.units if u.kind == "block"] == []


def test_three_dtype_groups_keep_target_unit_when_it_must_hold_ignored_params() -> None:
    # attn.q holds only the ignored weight, so no child unit reaches it: the block must.
    transform = functools.partial(fsdptx.shard_by_dtype, ignored_params=["layers.0.attn.q.weight"])
    p = fsdptx.plan(master_weights(make_decoder(1), "gate.proj.weight"), transform, mp_policy=BF16_POLICY)
    block = unit_for(p, "layers.0")
    assert block.kind == "block" and block.params == () and block.ignored_params == ("layers.0.attn.q.weight",)


def test_dtype_child_units_get_internal_policy_without_output_dtype() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32)
    p = fsdptx.plan(make_decoder(1), fsdptx.shard_by_dtype, mp_policy=policy)
    children = dtype_units_on(p, "layers.0")
    assert children and {u.mp_policy.output_dtype for u in children.values()} == {None}  # type: ignore[union-attr]


def test_dtype_target_unit_keeps_callers_output_dtype() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32)
    p = fsdptx.plan(make_decoder(1), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks), mp_policy=policy)
    block, root = unit_for(p, "layers.0"), unit_for(p, "")
    assert block.mp_policy is not None and block.mp_policy.output_dtype == FP32
    assert root.mp_policy is not None and root.mp_policy.output_dtype == FP32


def test_fp32_dtype_child_policy_reduces_in_fp32_and_does_not_cast_inputs() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, output_dtype=BF16)
    p = fsdptx.plan(make_decoder(1), fsdptx.shard_by_dtype, mp_policy=policy)
    sinks = unit_for(p, "layers.0.attn.sinks").mp_policy
    assert sinks == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_low_precision_dtype_child_policy_keeps_callers_reduce_and_input_cast() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=BF16)
    p = fsdptx.plan(master_weights(make_decoder(1), "gate.proj.weight"), fsdptx.shard_by_dtype, mp_policy=policy)
    gate = unit_for(p, "layers.0.gate").mp_policy
    assert gate == MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=True)


def test_disabled_mixed_precision_leaves_every_unit_policy_none() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.compose(*PIPELINE_PARTS))
    assert {u.mp_policy for u in p.units} == {None}


def test_root_unit_owns_exactly_what_no_block_owns() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks))
    root = p.units[-1]
    assert (root.kind, root.modules) == ("root", ("",))
    assert root.params == ("embed.weight", "head.weight", "norm.bias", "norm.weight")


def test_root_unit_exists_even_when_blocks_own_everything() -> None:
    model = tree(layers=nn.ModuleList([Holder(BF16), Holder(BF16)]))
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert unit_modules(p) == [("layers.0",), ("layers.1",), ("",)]
    assert p.units[-1].params == ()


def test_module_list_minority_subtree_is_sharded_as_its_elements() -> None:
    blk = tree(a=Holder(BF16, 2), b=Holder(BF16, 1), experts=nn.ModuleList([Holder(FP32), Holder(FP32)]))
    p = fsdptx.plan(tree(blk=blk), functools.partial(fsdptx.shard_by_dtype, blocks=["blk"]))
    assert unit_modules(p) == [("blk.experts.0",), ("blk.experts.1",), ("blk",), ("",)]


def test_module_list_subtree_skips_elements_already_planned_as_blocks() -> None:
    # layers.0 is a block unit; the root's bf16 minority subtree is then the
    # list, whose only unplanned element is layers.1.
    model = tree(layers=nn.ModuleList([Holder(BF16), Holder(BF16)]), extra=Holder(FP32, 2))
    p = fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0"]))
    assert unit_modules(p) == [("layers.0",), ("layers.1",), ("",)]
    assert p.units[1].kind == "dtype" and p.units[2].params == ("extra.w0", "extra.w1")


# --------------------------------------------------------------------------- shard_across_blocks


def test_shard_across_blocks_bare_makes_one_unit_spanning_every_block() -> None:
    p = fsdptx.plan(make_decoder(3), fsdptx.shard_across_blocks)
    unit = only(u for u in p.units if u.kind == "cross-block")
    assert unit.modules == ("layers.0.attn.sinks", "layers.1.attn.sinks", "layers.2.attn.sinks")
    assert unit.params == tuple(f"layers.{i}.attn.sinks.weight" for i in range(3))


def test_shard_across_blocks_unit_uses_fp32_internal_policy() -> None:
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, output_dtype=BF16)
    p = fsdptx.plan(make_decoder(), fsdptx.shard_across_blocks, mp_policy=policy)
    assert p.units[0].mp_policy == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )


def test_shard_across_blocks_unit_is_not_resharded_after_forward() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.shard_across_blocks, reshard_after_forward=True)
    assert p.units[0].reshard_after_forward is False


def test_shard_across_blocks_option_module_names_overrides_model_declaration() -> None:
    transform = functools.partial(fsdptx.shard_across_blocks, module_names=["gate"])
    p = fsdptx.plan(make_decoder(), transform)
    assert unit_modules(p) == [("layers.0.gate", "layers.1.gate")]


def test_shard_across_blocks_option_blocks_limits_the_span() -> None:
    transform = functools.partial(fsdptx.shard_across_blocks, blocks=["layers.0", "layers.2"])
    p = fsdptx.plan(make_decoder(3), transform)
    assert unit_modules(p) == [("layers.0.attn.sinks", "layers.2.attn.sinks")]


def test_shard_across_blocks_without_declared_names_returns_plan_unchanged() -> None:
    class Undeclared(TinyDecoder):
        _fsdp_shard_across_blocks: list[str] = []

    start = fsdptx.plan(Undeclared(), fsdptx.mark_reduction)
    assert fsdptx.shard_across_blocks(Undeclared(), start) is start


def test_shard_across_blocks_looks_through_checkpoint_wrappers() -> None:
    model = make_decoder()
    for i, block in enumerate(list(model.layers)):
        model.layers[i] = checkpoint_wrapper(block)
    p = fsdptx.plan(model, fsdptx.shard_across_blocks)
    assert unit_modules(p) == [
        ("layers.0._checkpoint_wrapped_module.attn.sinks", "layers.1._checkpoint_wrapped_module.attn.sinks")
    ]


def test_shard_by_dtype_excludes_cross_block_holders_from_dtype_units() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.compose(fsdptx.shard_across_blocks, fsdptx.shard_by_dtype))
    holders = {f"layers.{i}.attn.sinks.weight" for i in range(2)}
    assert [u.kind for u in p.units if holders & set(u.params)] == ["cross-block"]


# --------------------------------------------------------------------------- mark_reduction


def test_mark_reduction_bare_marks_params_from_tp_replica_reductions() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.mark_reduction)
    assert dict(p.reductions) == {
        "layers.0.gate.proj.weight": "sum",
        "layers.1.gate.proj.weight": "sum",
        "norm.bias": "mean",
        "norm.weight": "mean",
    }


def test_mark_reduction_bare_reads_tp_replica_sync_exclude() -> None:
    class WithExclusions(TinyDecoder):
        _tp_replica_sync_exclude = ["layers.*.mlp"]

    p = fsdptx.plan(WithExclusions(), fsdptx.mark_reduction)
    assert p.exclusions == ("layers.0.mlp", "layers.1.mlp")


def test_mark_reduction_option_reductions_override_model_declaration() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={"layers.1.attn.q": "sum", "head": "mean"})
    p = fsdptx.plan(make_decoder(), transform)
    assert dict(p.reductions) == {"head.weight": "mean", "layers.1.attn.q.weight": "sum"}


def test_mark_reduction_refuses_a_glob_whose_modules_hold_no_direct_parameters() -> None:
    """A mark applies to a module's own parameters: a glob on a pure
    container would mark nothing, which used to pass silently."""
    transform = functools.partial(fsdptx.mark_reduction, reductions={"layers.0.attn": "sum"})
    with pytest.raises(fsdptx.PlanningError, match="none of which holds a parameter directly"):
        fsdptx.plan(make_decoder(), transform)


def test_mark_reduction_option_exclude_records_module_fqns() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={}, exclude=["layers.1.*", "embed"])
    p = fsdptx.plan(make_decoder(), transform)
    assert set(p.exclusions) == {"embed"} | {
        f for f, _ in make_decoder().named_modules() if f.startswith("layers.1.")
    }


def test_mark_reduction_leaves_units_alone() -> None:
    model = make_decoder()
    base = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert fsdptx.mark_reduction(model, base).units == base.units


# --------------------------------------------------------------------------- compose, purity, printing


def test_compose_gives_the_same_plan_in_all_six_orders() -> None:
    model = make_decoder(3)
    plans = [
        fsdptx.plan(model, fsdptx.compose(*order), mp_policy=BF16_POLICY)
        for order in itertools.permutations(PIPELINE_PARTS)
    ]
    assert len(plans) == 6 and all(p == plans[0] for p in plans[1:])


class NeedsHolderClaimed(nn.Module):
    """Each block's own bf16 ``w`` is only plannable once the fp32 holder ``h``
    (the block's majority) belongs to the cross-block unit: planned by dtype
    alone, bf16 is the minority and ``w`` cannot be isolated."""

    _fsdp_shard_across_blocks = ["h"]
    _tp_replica_reductions = {"layers.*.x": "sum"}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(2):
            block = tree(x=Holder(BF16, 1), h=Holder(FP32, 3))
            block.w = param(2)
            self.layers.append(block)


def test_shard_by_dtype_alone_splits_block_whose_direct_params_are_the_minority() -> None:
    # Without the cross-block unit, bf16 is the minority and sits directly on
    # the block: the children get units and the block keeps only its own w.
    p = fsdptx.plan(NeedsHolderClaimed(), fsdptx.shard_by_dtype)
    assert unit_modules(p)[:3] == [("layers.0.h",), ("layers.0.x",), ("layers.0",)]
    assert unit_for(p, "layers.0").params == ("layers.0.w",)


def test_compose_plans_cross_block_holders_first_in_all_six_orders() -> None:
    model = NeedsHolderClaimed()
    plans = [fsdptx.plan(model, fsdptx.compose(*order)) for order in itertools.permutations(PIPELINE_PARTS)]
    assert all(p == plans[0] for p in plans[1:])
    assert unit_modules(plans[0]) == [("layers.0.h", "layers.1.h"), ("layers.0",), ("layers.1",), ("",)]


def test_compose_of_nothing_returns_the_start_plan() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.compose(), mp_policy=BF16_POLICY)
    assert p == Plan(mp_policy=BF16_POLICY)


def test_plan_does_not_change_the_model() -> None:
    model = make_decoder()
    before = {f: (p, p.dtype, p.shape, p.device, p.detach().clone()) for f, p in model.named_parameters()}
    modules_before = dict(model.named_modules())
    fsdptx.plan(model, fsdptx.compose(*PIPELINE_PARTS), mp_policy=BF16_POLICY)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for f, (obj, dtype, shape, device, values) in before.items():
        assert after[f] is obj and (obj.dtype, obj.shape, obj.device) == (dtype, shape, device)
        assert torch.equal(obj.detach(), values)
    assert dict(model.named_modules()) == modules_before


def test_plan_is_immutable() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.shard_by_dtype)
    with pytest.raises(AttributeError):
        p.units = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        p.reductions["x"] = "sum"  # type: ignore[index]


def test_str_plan_has_one_row_per_unit_with_storage_to_compute() -> None:
    p = fsdptx.plan(
        master_weights(make_decoder(), "gate.proj.weight"), fsdptx.compose(*PIPELINE_PARTS), mp_policy=BF16_POLICY
    )
    text = str(p)
    rows = [line for line in text.splitlines() if line.split()[0].isdigit() and "->" in line]
    assert len(rows) == len(p.units)
    assert "layers.{0..1}.attn.sinks" in rows[0] and "float32->float32" in rows[0]
    assert "layers.0.gate" in rows[1] and "float32->bfloat16" in rows[1]
    assert "<root>" in rows[-1] and "bfloat16->bfloat16" in rows[-1]


def test_str_of_a_composed_plan_names_every_unit_by_its_modules_in_order() -> None:
    p = fsdptx.plan(
        master_weights(make_decoder(6), "gate.proj.weight"), fsdptx.compose(*PIPELINE_PARTS), mp_policy=BF16_POLICY
    )
    lines = str(p).splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"#\s+kind\s+modules", line))
    cells = [re.split(r"\s{2,}", line) for line in lines[header + 2 : header + 2 + len(p.units)]]
    assert [c[0] for c in cells] == [str(i) for i in range(len(p.units))]
    assert [(c[1], c[2]) for c in cells] == [(u.kind, join_names(u.modules)) for u in p.units]
    # Only a unit that spans blocks collapses its names; each block keeps its own row.
    assert [c[2] for c in cells if c[1] == "block"] == [f"layers.{i}" for i in range(6)]
    assert lines[header + 2 + len(p.units)].startswith(f"{len(p.units)} units, ")


def test_model_on_meta_device_plans_like_the_real_model() -> None:
    pipeline = fsdptx.compose(*PIPELINE_PARTS)
    on_meta = fsdptx.plan(make_decoder(device="meta"), pipeline, mp_policy=BF16_POLICY)
    on_cpu = fsdptx.plan(make_decoder(), pipeline, mp_policy=BF16_POLICY)
    assert on_meta == on_cpu and len(on_meta.units) == 6


# --------------------------------------------------------------------------- errors


def test_transform_returning_non_plan_raises_naming_the_transform() -> None:
    def forgets_to_return(model: nn.Module, p: Plan) -> Plan:
        p.replace(exclusions=("x",))
        return None  # type: ignore[return-value]

    with pytest.raises(TypeError, match="forgets_to_return.*NoneType"):
        fsdptx.plan(make_decoder(), fsdptx.compose(fsdptx.shard_by_dtype, forgets_to_return))


def test_cross_block_holder_with_non_fp32_param_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.shard_across_blocks, module_names=["attn"])
    with pytest.raises(PlanningError) as info:
        fsdptx.plan(make_decoder(), transform)
    message = str(info.value)
    assert "'attn'" in message and "layers.0.attn.q.weight is bfloat16" in message
    assert "layers.1.attn.o.weight is bfloat16" in message
    assert "sinks" not in message


def test_cross_block_name_found_in_no_block_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.shard_across_blocks, module_names=["attn.sink"])
    with pytest.raises(PlanningError, match=r"no block has a submodule 'attn\.sink'.*'layers\.0'"):
        fsdptx.plan(make_decoder(), transform)


def test_cross_block_without_blocks_raises_naming_the_names() -> None:
    model = tree(holder=Holder(FP32))
    transform = functools.partial(fsdptx.shard_across_blocks, module_names=["holder"])
    with pytest.raises(PlanningError, match=r"found no blocks.*\['holder'\]"):
        fsdptx.plan(model, transform)


def test_unknown_reduction_raises_naming_glob_and_reduction() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={"norm": "avg"})
    with pytest.raises(ValueError, match=r"'avg' for 'norm'"):
        fsdptx.plan(make_decoder(), transform)


def test_reduction_glob_matching_nothing_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={"layers.*.router": "sum"})
    with pytest.raises(PlanningError, match=r"'layers\.\*\.router' matches no module"):
        fsdptx.plan(make_decoder(), transform)


def test_exclusion_glob_matching_nothing_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={}, exclude=["experts*"])
    with pytest.raises(PlanningError, match=r"exclusion glob 'experts\*' matches no module"):
        fsdptx.plan(make_decoder(), transform)


def test_parameter_marked_both_mean_and_sum_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.mark_reduction, reductions={"norm": "mean", "n*": "sum"})
    with pytest.raises(PlanningError, match=r"'norm\.weight' is marked both 'mean'"):
        fsdptx.plan(make_decoder(), transform)


def test_module_mixing_trainable_dtypes_directly_raises_naming_every_such_parameter() -> None:
    model = make_decoder()
    model.layers[1].attn.bias_fp32 = param(DIM, dtype=FP32)  # fp32 beside a bf16 one, both on attn
    model.layers[1].attn.scale_bf16 = param(DIM, dtype=BF16)
    with pytest.raises(PlanningError) as info:
        fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    message = str(info.value)
    assert "layers.1.attn.bias_fp32 (float32->float32)" in message  # intrinsic fp32 in a bf16-bulk model
    assert "layers.1.attn.scale_bf16 (bfloat16->bfloat16)" in message
    assert "'layers.1'" in message and "Split the module" in message


def test_fp32_params_directly_on_block_and_attention_get_units_of_their_own() -> None:
    model = make_decoder()
    model.layers[1].scale = param(DIM, dtype=FP32)
    model.layers[1].attn.bias_fp32 = param(DIM, dtype=FP32)
    master_weights(model, "gate.proj.weight", "scale", "bias_fp32")
    p = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=BF16_POLICY)
    assert unit_for(p, "layers.1.attn").params == ("layers.1.attn.bias_fp32",)
    assert unit_for(p, "layers.1").params == ("layers.1.scale",)


def test_parameter_tied_across_two_units_raises_naming_both_names() -> None:
    model = make_decoder()
    model.layers[1].mlp.up.weight = model.layers[0].mlp.up.weight
    with pytest.raises(PlanningError) as info:
        fsdptx.plan(model, fsdptx.shard_by_dtype)
    message = str(info.value)
    assert "layers.0.mlp.up.weight" in message and "layers.1.mlp.up.weight" in message


def test_parameter_tied_within_one_unit_plans_once() -> None:
    model = make_decoder()
    model.head.weight = model.embed.weight  # both on the root unit
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    assert p.units[-1].params == ("embed.weight", "norm.bias", "norm.weight")


def test_unknown_block_raises_naming_the_path() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, blocks=["layers.7"])
    with pytest.raises(PlanningError, match=r"layers\.7"):
        fsdptx.plan(make_decoder(), transform)


def test_unknown_ignored_param_raises_naming_it() -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, ignored_params=["layers.0.nope.weight"])
    with pytest.raises(PlanningError, match=r"'layers\.0\.nope\.weight'"):
        fsdptx.plan(make_decoder(), transform)


def test_invalid_reshard_after_forward_is_a_planning_error() -> None:
    with pytest.raises(fsdptx.PlanningError, match="reshard_after_forward must be None, True, False"):
        fsdptx.plan(make_decoder(), functools.partial(fsdptx.shard_by_dtype, reshard_after_forward=0))


def test_blocks_given_as_one_string_mean_that_one_block() -> None:
    p = fsdptx.plan(make_decoder(), functools.partial(fsdptx.shard_by_dtype, blocks="layers.0"))
    assert "layers.0" in [u.modules[0] for u in p.units]
    assert "layers.1" not in [u.modules[0] for u in p.units]


def test_nested_blocks_are_refused_naming_both() -> None:
    with pytest.raises(fsdptx.PlanningError, match="'layers.0' and 'layers.0.attn' overlap"):
        fsdptx.plan(make_decoder(), functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0", "layers.0.attn"]))


def test_composing_shard_by_dtype_twice_is_refused() -> None:
    twice = fsdptx.compose(
        functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0"]),
        functools.partial(fsdptx.shard_by_dtype, blocks=["layers.1"]),
    )
    with pytest.raises(fsdptx.PlanningError, match="already has a dtype request"):
        fsdptx.plan(make_decoder(), twice)


def test_module_list_target_is_planned_as_its_elements() -> None:
    p = fsdptx.plan(make_decoder(), functools.partial(fsdptx.shard_by_dtype, blocks=["layers"]))
    block_units = [u.modules for u in p.units if u.kind == "block"]
    assert block_units == [("layers.0",), ("layers.1",)]


def test_repeated_cross_block_name_is_refused() -> None:
    with pytest.raises(fsdptx.PlanningError, match=r"module names \['attn.sinks'\] are listed more than once"):
        fsdptx.plan(
            make_decoder(),
            functools.partial(fsdptx.shard_across_blocks, module_names=("attn.sinks", "attn.sinks")),
        )


def test_plan_survives_pickling() -> None:
    p = fsdptx.plan(make_decoder(), fsdptx.compose(*PIPELINE_PARTS), mp_policy=BF16_POLICY)
    assert pickle.loads(pickle.dumps(p)) == p


def test_a_reduction_mark_inside_an_excluded_module_is_refused_when_planning_and_applying() -> None:
    """TP-replica sync skips excluded subtrees, so the mark would silently
    never be applied."""
    model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))
    both = functools.partial(
        fsdptx.mark_reduction, reductions={"layers.0.attn.q_proj": "sum"}, exclude=["layers.0.attn"]
    )
    with pytest.raises(PlanningError, match=r"'layers\.0\.attn\.q_proj\.weight'.*'layers\.0\.attn'") as refused:
        fsdptx.plan(model, both)
    assert "sequence_parallel" not in str(refused.value)  # the expert advice is for expert modules only
    marked = fsdptx.plan(model, functools.partial(fsdptx.mark_reduction, reductions={"layers.0.attn.q_proj": "sum"}))
    edited = marked.replace(exclusions=("layers.0",))
    with pytest.raises(fsdptx.PlanMismatchError, match=r"would never be applied"):
        fsdptx.apply_plan(edited, model, None, shard_module=lambda *a, **k: None)  # type: ignore[arg-type]
