"""Bad input is refused up front, naming what is wrong.

Every case here used to be accepted and fail later (or never): an unknown
reduction treated as another, a string policy sharding every unit before
failing, an ``AttributeError`` from deep inside torch, an unhashable plan,
a stale plan applied without a word.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig


def small() -> Decoder:
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, modules: Any, **kwargs: Any) -> None:
        self.calls.append(modules)


def test_plan_refuses_an_unknown_reduction() -> None:
    with pytest.raises(ValueError, match="'max'"):
        fsdptx.Plan(reductions={"layers.0.attn_norm.weight": "max"})  # type: ignore[dict-item]


def _with_unit_policy(**changes: Any) -> tuple[fsdptx.Plan, Decoder]:
    model = small()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    units = list(p.units)
    units[0] = dataclasses.replace(units[0], **changes)
    return p.replace(units=tuple(units)), model


@pytest.mark.parametrize("changes", [{"mp_policy": "bf16"}, {"offload_policy": "cpu"}], ids=["mp", "offload"])
def test_apply_refuses_a_policy_of_the_wrong_type_before_sharding_anything(changes: dict[str, str]) -> None:
    p, model = _with_unit_policy(**changes)
    rec = Recorder()
    with pytest.raises(fsdptx.PlanMismatchError, match="unit 0"):
        fsdptx.apply_plan(p, model, object(), shard_module=rec)  # type: ignore[arg-type]
    assert rec.calls == []


def test_plan_with_an_offload_policy_is_hashable_and_equal_plans_hash_alike() -> None:
    a = fsdptx.plan(small(), fsdptx.shard_by_dtype, offload_policy=CPUOffloadPolicy())
    b = fsdptx.plan(small(), fsdptx.shard_by_dtype, offload_policy=CPUOffloadPolicy())
    assert a == b and hash(a) == hash(b)


def test_apply_refuses_a_plan_made_before_the_model_was_cast() -> None:
    model = small()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    model.to(torch.bfloat16)
    rec = Recorder()
    with pytest.raises(fsdptx.PlanMismatchError, match="planned for float32 storage.*bfloat16 now"):
        fsdptx.apply_plan(p, model, object(), shard_module=rec)  # type: ignore[arg-type]
    assert rec.calls == []


def test_make_compute_dtype_fn_reads_a_bare_string_as_one_name() -> None:
    # The one rule for names (as shard_by_dtype and fully_shard_by_dtype read
    # them): "sinks" is the token "sinks", not the letters s, i, n, k.
    model = small()
    by_string = fsdptx.make_compute_dtype_fn(model, None, "sinks")
    by_list = fsdptx.make_compute_dtype_fn(model, None, ["sinks"])
    assert [by_string(p) for p in model.parameters()] == [by_list(p) for p in model.parameters()]


def test_make_compute_dtype_fn_refuses_names_that_are_not_strings() -> None:
    with pytest.raises(TypeError, match=r"fp32_compute_module_names must hold names \(str\), got \[3\]"):
        fsdptx.make_compute_dtype_fn(small(), None, ["sinks", 3])  # type: ignore[list-item]


CALLS: dict[str, Callable[[object], object]] = {
    "plan": lambda bad: fsdptx.plan(bad, fsdptx.shard_by_dtype),  # type: ignore[arg-type]
    "check_plan(plan)": lambda bad: fsdptx.check_plan(bad, small()),  # type: ignore[arg-type]
    "check_plan(model)": lambda bad: fsdptx.check_plan(fsdptx.Plan(), bad),  # type: ignore[arg-type]
    "apply_plan(model)": lambda bad: fsdptx.apply_plan(fsdptx.Plan(), bad, object()),  # type: ignore[arg-type]
    "make_compute_dtype_fn": lambda bad: fsdptx.make_compute_dtype_fn(bad, None),  # type: ignore[arg-type]
    "group_params_by_dtype": lambda bad: fsdptx.group_params_by_dtype(bad),  # type: ignore[arg-type]
    "iter_maximal_uniform_dtype_subtrees": lambda bad: list(fsdptx.iter_maximal_uniform_dtype_subtrees(bad)),  # type: ignore[arg-type]
    "get_module_from_path": lambda bad: fsdptx.get_module_from_path(bad, "a"),  # type: ignore[arg-type]
    "iter_unique_named_parameters": lambda bad: list(fsdptx.iter_unique_named_parameters([bad])),  # type: ignore[list-item]
}


@pytest.mark.parametrize("bad", [None, "model", 3], ids=["None", "str", "int"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_public_function_names_the_argument_of_the_wrong_type(call: str, bad: object) -> None:
    with pytest.raises(TypeError, match=r"must be (a torch\.nn\.Module|an fsdptx\.Plan)"):
        CALLS[call](bad)


def test_plan_refuses_a_policy_given_as_a_string() -> None:
    with pytest.raises(TypeError, match="mp_policy"):
        fsdptx.plan(small(), fsdptx.shard_by_dtype, mp_policy="bf16")  # type: ignore[arg-type]


def test_mixed_precision_policy_object_still_plans() -> None:
    p = fsdptx.plan(small(), fsdptx.shard_by_dtype, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert all(u.compute_dtype == torch.bfloat16 for u in p.units)




class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


class _Model(nn.Module):
    def __init__(self, declared: object) -> None:
        super().__init__()
        self._no_split_modules = declared
        self.stack = nn.Sequential(_Blk(), _Blk())  # not a ModuleList: no fallback to find them
        self.head = nn.Linear(4, 4)


def test_no_split_modules_as_a_bare_string_is_one_class_name() -> None:
    p = fsdptx.plan(_Model("_Blk"), fsdptx.shard_by_dtype)
    assert [u.modules[0] for u in p.units if u.kind == "block"] == ["stack.0", "stack.1"]


def test_no_split_modules_of_the_wrong_type_names_the_attribute() -> None:
    with pytest.raises(TypeError, match="_no_split_modules"):
        fsdptx.plan(_Model(5), fsdptx.shard_by_dtype)


class _Holderless(nn.Module):
    """``wrapper`` owns nothing directly; its child ``inner`` owns the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapper = nn.Sequential(nn.Linear(4, 4))
        self.empty = nn.Identity()


def test_reduction_glob_matching_only_modules_without_direct_parameters_is_refused() -> None:
    mark = functools.partial(fsdptx.mark_reduction, reductions={"wrapper": "sum"})
    with pytest.raises(fsdptx.PlanningError, match=r"'wrapper'.*none of which holds a parameter directly.*'wrapper\.\*'"):
        fsdptx.plan(_Holderless(), mark)


def test_exclusion_glob_matching_only_empty_subtrees_is_refused() -> None:
    mark = functools.partial(fsdptx.mark_reduction, exclude=["empty"])
    with pytest.raises(fsdptx.PlanningError, match="no parameter or buffer"):
        fsdptx.plan(_Holderless(), mark)


def test_exclusion_glob_on_a_parent_of_parameters_is_accepted() -> None:
    p = fsdptx.plan(_Holderless(), functools.partial(fsdptx.mark_reduction, exclude=["wrapper"]))
    assert p.exclusions == ("wrapper",)
