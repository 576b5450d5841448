"""A plan's tensor-parallel styles are part of its value: two plans whose
styles do different things never compare equal, hash alike by accident of
the readable name, diff empty, or read back from a file as the other.

A style's value is its class and every setting it holds (layouts, desired
layouts, kwarg layouts, ``use_local_output``, ``src_data_rank``, ...),
taken when the plan is made: applying a style changes some of its
attributes, and the plan stays what it was."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

import fsdptx
from fsdptx.cli._main import main
from fsdptx.plan._plan import Plan
from fsdptx.plan._types import TensorParallel, TPAssignment


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(self.a(x))
        return out


def tp_plan(style: ParallelStyle) -> Plan:
    """``a`` colwise, ``b`` with ``style``: only ``b``'s style varies."""
    transform = functools.partial(fsdptx.tensor_parallel, plan={"a": ColwiseParallel(), "b": style})
    return fsdptx.plan(TwoLinear(), transform)


def _with_src_data_rank(style: ParallelStyle, rank: int | None) -> ParallelStyle:
    style.src_data_rank = rank
    return style


# Pairs of styles with the same readable name in the plan (the name shows
# the class and its stream layouts) that do different things.
ALIKE_BY_NAME: dict[str, tuple[Any, Any, str]] = {
    "rowwise-use_local_output": (RowwiseParallel, lambda: RowwiseParallel(use_local_output=False), "use_local_output True -> False"),
    "colwise-use_local_output": (ColwiseParallel, lambda: ColwiseParallel(use_local_output=False), "use_local_output True -> False"),
    "sequence-use_local_output": (SequenceParallel, lambda: SequenceParallel(use_local_output=True), "use_local_output False -> True"),
    "src_data_rank": (RowwiseParallel, lambda: _with_src_data_rank(RowwiseParallel(), None), "src_data_rank (unset) -> None"),
    "prepare-input-kwargs": (
        lambda: PrepareModuleInput(input_kwarg_layouts={"mask": Shard(1)}, desired_input_kwarg_layouts={"mask": Replicate()}),
        lambda: PrepareModuleInput(input_kwarg_layouts={"mask": Shard(1)}, desired_input_kwarg_layouts={"mask": Shard(1)}),
        "desired_input_kwarg_layouts {mask: Replicate()} -> {mask: Shard(1)}",
    ),
    "prepare-output-local": (
        lambda: PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        lambda: PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=False),
        "use_local_output True -> False",
    ),
}


@pytest.mark.parametrize("case", sorted(ALIKE_BY_NAME))
def test_styles_alike_by_name_but_not_in_behaviour_make_unequal_plans(case: str) -> None:
    make_old, make_new, change = ALIKE_BY_NAME[case]
    old, new = tp_plan(make_old()), tp_plan(make_new())
    assert old.tensor_parallel is not None and new.tensor_parallel is not None
    names = [{a.module: a.style for a in p.tensor_parallel.assignments} for p in (old, new)]  # type: ignore[union-attr]
    assert names[0] == names[1]  # the readable names alone cannot tell them apart
    assert old != new
    assert str(fsdptx.diff_plans(old, new)) == f"b: TP style {change}"


@pytest.mark.parametrize("case", sorted(ALIKE_BY_NAME))
def test_a_plan_file_keeps_every_setting_of_each_style(case: str) -> None:
    make_old, make_new, _change = ALIKE_BY_NAME[case]
    old, new = tp_plan(make_old()), tp_plan(make_new())
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(new))
    assert back == new and back != old
    assert hash(back) == hash(new)
    style = back.tensor_parallel.assignments[1].parallel_style  # type: ignore[union-attr]
    assert type(style) is type(new.tensor_parallel.assignments[1].parallel_style)  # type: ignore[union-attr]


def test_styles_built_apart_with_the_same_settings_make_equal_plans_with_equal_hashes() -> None:
    a = tp_plan(RowwiseParallel(use_local_output=False))
    b = tp_plan(RowwiseParallel(use_local_output=False))
    assert a == b and hash(a) == hash(b)
    assert not fsdptx.diff_plans(a, b)


def test_applying_a_style_leaves_the_plans_value_and_file_as_they_were() -> None:
    """torch's parallelize_module sets src_data_rank on every style, and
    RowwiseParallel sets its desired input layouts when applied to an
    embedding: done here by hand, as applying does."""
    p = tp_plan(RowwiseParallel())
    q = tp_plan(RowwiseParallel())
    text, value = fsdptx.plan_to_json(p), hash(p)
    style = p.tensor_parallel.assignments[1].parallel_style  # type: ignore[union-attr]
    style.src_data_rank = 0
    style.desired_input_layouts = (Replicate(),)  # type: ignore[attr-defined]
    assert p == q and hash(p) == value
    assert fsdptx.plan_to_json(p) == text


class Scaled(ParallelStyle):
    """A user style fsdptx cannot rebuild from a file."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


def with_style(style: ParallelStyle) -> Plan:
    tp = TensorParallel((TPAssignment("b", "scaled", "b", style),), False)
    return Plan(tensor_parallel=tp)


def test_a_user_style_compares_by_its_settings_also_after_reading_it_back() -> None:
    three, four = with_style(Scaled(3)), with_style(Scaled(4))
    assert three != four and three == with_style(Scaled(3))
    assert str(fsdptx.diff_plans(three, four)) == "b: TP style factor 3 -> 4"
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(three))
    assert back == three and back != four


class Hooked(ParallelStyle):
    """A user style holding something no plan file can describe."""

    def __init__(self, hook: Any) -> None:
        super().__init__()
        self.hook = hook

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


def test_a_style_holding_what_no_file_can_describe_equals_only_itself_and_is_not_written() -> None:
    style = Hooked(print)
    one = with_style(style)
    assert one == dataclasses.replace(one)  # the same style object
    assert one != with_style(Hooked(print))  # another object: nothing says they do the same
    with pytest.raises(TypeError, match=r"plan\.tensor_parallel\.assignments\[0\]\.parallel_style.*Hooked\.hook"):
        fsdptx.plan_to_json(one)


def test_python_m_fsdptx_diff_exits_1_for_plans_that_differ_only_in_use_local_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    before.write_text(fsdptx.plan_to_json(tp_plan(RowwiseParallel())))
    after.write_text(fsdptx.plan_to_json(tp_plan(RowwiseParallel(use_local_output=False))))
    code = main(["diff", str(before), str(after)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines() == [f"--- {before}", f"+++ {after}", "b: TP style use_local_output True -> False"]
    assert json.loads(after.read_text())["plan"]["tensor_parallel"]["assignments"][1]["parallel_style"][
        "attributes"
    ]["use_local_output"] is False


def test_a_plan_applied_for_real_still_equals_a_fresh_one_and_writes_the_same_file() -> None:
    """parallelize_module records src_data_rank on every style and desired
    input layouts on the rowwise embedding: neither is a setting."""
    from fsdptx.presets import Decoder, DecoderConfig
    from fsdptx.testing import fake_mesh

    cfg = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh)
        model = Decoder(cfg)
        p = manager.plan(model)
        text, value = fsdptx.plan_to_json(p), hash(p)
        fsdptx.apply_plan(p, model, mesh)
        assert p.tensor_parallel is not None
        embedding = next(a for a in p.tensor_parallel.assignments if a.module == "embed_tokens").parallel_style
        assert "src_data_rank" in vars(embedding) and "desired_input_layouts" in vars(embedding)  # applying recorded them
        fresh = manager.plan(Decoder(cfg))
    # the same applied style objects in new assignments: their settings read anew
    tp = p.tensor_parallel
    reread = p.replace(tensor_parallel=dataclasses.replace(tp, assignments=tuple(dataclasses.replace(a) for a in tp.assignments)))
    for q in (p, reread):
        assert q == fresh and hash(q) == value == hash(fresh)
        assert fsdptx.plan_to_json(q) == text == fsdptx.plan_to_json(fresh)
