"""Plans as data files: the JSON schema, the readable diff, and the CLI's
``plan --json`` / ``diff`` that carry them into CI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

import fsdptx
from fsdptx.cli._main import main
from fsdptx.plan import _types as plan_types  # the package fsdptx.plan is shadowed by the function fsdptx.plan
from fsdptx.plan._json import DescribedStyle
from fsdptx.plan._plan import Plan
from fsdptx.plan._types import TensorParallel, TPAssignment
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=4, fp32_holders=True)


def meta_model() -> Decoder:
    with torch.device("meta"):
        return Decoder(CFG)


def manager_plan(**config: Any) -> Plan:
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        return fsdptx.FSDP2Manager(fsdptx.FSDP2Config(**config), mesh).plan(meta_model())


# --------------------------------------------------------------------------- schema


def test_a_manager_plan_with_sp_ac_and_cross_block_units_reads_back_equal() -> None:
    p = manager_plan(sequence_parallel=True, activation_checkpointing="full")
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(p))
    assert back == p
    assert back.tensor_parallel is not None and p.tensor_parallel is not None
    for before, after in zip(p.tensor_parallel.assignments, back.tensor_parallel.assignments):
        assert type(after.parallel_style) is type(before.parallel_style), before.module
        assert vars(after.parallel_style) == vars(before.parallel_style), before.module


def test_the_document_is_versioned_sorted_and_stable() -> None:
    p = manager_plan(sequence_parallel=True)
    text = fsdptx.plan_to_json(p)
    data = json.loads(text)
    assert data["schema"] == 1
    assert text == json.dumps(data, indent=1, sort_keys=True)
    assert fsdptx.plan_to_json(manager_plan(sequence_parallel=True)) == text


def test_dtypes_are_strings_and_torch_styles_are_described_by_layouts() -> None:
    data = json.loads(fsdptx.plan_to_json(manager_plan(sequence_parallel=True)))["plan"]
    assert data["mp_policy"]["param_dtype"] == {"__type__": "dtype", "name": "bfloat16"}
    head = next(a for a in data["tensor_parallel"]["assignments"] if a["module"] == "lm_head")
    style = head["parallel_style"]
    assert style["class"] == "ColwiseParallel"
    assert style["attributes"]["input_layouts"] == [{"__type__": "Shard", "dim": 1}]
    assert style["attributes"]["output_layouts"] == [{"__type__": "Replicate"}]
    assert style["attributes"]["desired_input_layouts"] == [{"__type__": "Replicate"}]
    assert style["attributes"]["use_local_output"] is True


def test_an_unknown_schema_version_or_field_is_refused_naming_it() -> None:
    data = json.loads(fsdptx.plan_to_json(manager_plan()))
    with pytest.raises(ValueError, match="schema 2 is not supported"):
        fsdptx.plan_from_json(json.dumps({**data, "schema": 2}))
    data["plan"]["units"][0]["colour"] = "blue"
    with pytest.raises(ValueError, match=r"plan\.units\[0\] \(Unit\) has fields \['colour'\]"):
        fsdptx.plan_from_json(json.dumps(data))
    with pytest.raises(ValueError, match="not JSON"):
        fsdptx.plan_from_json("{")
    with pytest.raises(TypeError, match="plan must be an fsdptx.Plan"):
        fsdptx.plan_to_json({"units": []})  # type: ignore[arg-type]


class Scaled(ParallelStyle):
    """A user style fsdptx cannot rebuild from a file."""

    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


def custom_style_plan() -> Plan:
    tp = TensorParallel((TPAssignment("layers.0.mlp.up_proj", "scaled", "layers.0.mlp.up_proj", Scaled(3)),), False)
    return fsdptx.plan(meta_model(), fsdptx.shard_by_dtype).replace(tensor_parallel=tp)


def test_another_style_class_keeps_its_description_and_reads_back_equal() -> None:
    p = custom_style_plan()
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(p))
    assert back == p
    style = back.tensor_parallel.assignments[0].parallel_style  # type: ignore[union-attr]
    assert isinstance(style, DescribedStyle)
    assert style.description["class"] == "Scaled" and style.description["attributes"] == {"factor": 3}
    assert fsdptx.plan_to_json(back) == fsdptx.plan_to_json(p)


def test_apply_plan_refuses_a_style_it_could_not_rebuild_naming_the_module_before_any_change() -> None:
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(custom_style_plan()))
    torch.manual_seed(0)
    model = Decoder(CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list[str] = []
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with pytest.raises(fsdptx.PlanMismatchError, match=r"TP module 'layers.0.mlp.up_proj'.*'Scaled'"):
            fsdptx.apply_plan(
                back,
                model,
                mesh,
                shard_module=lambda *a, **k: calls.append("shard"),
                parallelize_module=lambda *a, **k: calls.append("tp"),
            )
    assert calls == []
    assert all(type(p) is nn.Parameter and torch.equal(p, before[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- diff


def test_equal_plans_have_an_empty_falsy_diff() -> None:
    p = manager_plan(sequence_parallel=True)
    d = fsdptx.diff_plans(p, fsdptx.plan_from_json(fsdptx.plan_to_json(p)))
    assert not d and str(d) == "" and len(d) == 0


def test_a_checkpointing_change_is_one_line_over_all_blocks() -> None:
    d = fsdptx.diff_plans(manager_plan(activation_checkpointing="full"), manager_plan(activation_checkpointing="selective"))
    assert str(d) == "layers.{0..3}: checkpoint full -> selective"


def test_a_tensor_parallel_change_names_the_module() -> None:
    p = manager_plan()
    tp = p.tensor_parallel
    assert tp is not None
    kept = tuple(a for a in tp.assignments if a.module != "lm_head")
    q = p.replace(tensor_parallel=dataclasses.replace(tp, assignments=kept))
    assert "lm_head: colwise_rep -> (none)" in str(fsdptx.diff_plans(p, q)).splitlines()


def test_a_style_change_collapses_repeated_block_indices() -> None:
    p = manager_plan()
    tp = p.tensor_parallel
    assert tp is not None
    swapped = tuple(
        TPAssignment(a.module, "rowwise", a.pattern, RowwiseParallel()) if a.module.endswith("up_proj") else a
        for a in tp.assignments
    )
    q = p.replace(tensor_parallel=dataclasses.replace(tp, assignments=swapped))
    assert str(fsdptx.diff_plans(p, q)) == "layers.{0..3}.mlp.up_proj: colwise -> rowwise"


def test_unit_changes_name_the_units_and_the_parameters_they_gain() -> None:
    without = fsdptx.plan(meta_model(), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.mark_reduction))
    across = fsdptx.plan(
        meta_model(), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    )
    lines = str(fsdptx.diff_plans(across, without)).splitlines()
    assert "layers.{0..3}.sinks: cross-block unit removed" in lines
    assert "layers.{0..3}: unit gains sinks.weight" in lines
    lines = str(fsdptx.diff_plans(without, across)).splitlines()
    assert "layers.{0..3}.sinks: new cross-block unit of 4 params" in lines
    assert "layers.{0..3}: unit loses sinks.weight" in lines


def test_a_reduction_mark_change_names_the_parameter() -> None:
    p = manager_plan(sequence_parallel=True)
    q = p.replace(reductions={**p.reductions, "layers.3.attn_norm.weight": "sum"})
    assert str(fsdptx.diff_plans(p, q)) == "layers.3.attn_norm.weight: mean -> sum"


def test_a_unit_setting_change_is_one_line_per_unit_pattern() -> None:
    a = fsdptx.plan(meta_model(), fsdptx.shard_by_dtype)
    b = fsdptx.plan(meta_model(), fsdptx.shard_by_dtype, reshard_after_forward=False)
    assert str(fsdptx.diff_plans(a, b)).splitlines() == [
        "layers.{0..3}: unit reshard_after_forward (none) -> False",
        "<root>: unit reshard_after_forward (none) -> False",
        "reshard_after_forward: (none) -> False",
        "dtype_request.reshard_after_forward: (none) -> False",
    ]


# --------------------------------------------------------------------------- CLI


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def report(capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, *extra: str) -> Path:
    code, out, err = cli(capsys, "plan", "--preset", "llama", "--layers", "2", "--mesh", "dp=2,tp=2", "--sp", *extra, "--json")
    assert code == 0, err
    path = tmp_path / f"{name}.json"
    path.write_text(out)
    return path


def test_plan_json_report_carries_the_plan_schema_beside_its_keys(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = json.loads(report(capsys, tmp_path, "full", "--ac", "full").read_text())
    assert {"model", "units", "memory", "step"} <= set(data)
    plan = fsdptx.plan_from_json(json.dumps(data["plan"]))
    assert plan.checkpointing is not None and plan.checkpointing.mode == "full"
    assert [list(u.modules) for u in plan.units] == [u["modules"] for u in data["units"]]


def test_diff_of_two_reports_prints_the_change_and_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    full = report(capsys, tmp_path, "full", "--ac", "full")
    selective = report(capsys, tmp_path, "selective", "--ac", "selective")
    code, out, _ = cli(capsys, "diff", str(full), str(selective))
    assert code == 1
    assert out.splitlines() == [f"--- {full}", f"+++ {selective}", "layers.{0..1}: checkpoint full -> selective"]


def test_diff_of_equal_plans_exits_0_and_reads_bare_plan_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    full = report(capsys, tmp_path, "full", "--ac", "full")
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(json.loads(full.read_text())["plan"]))
    code, out, _ = cli(capsys, "diff", str(full), str(bare))
    assert code == 0 and "plans are equal" in out


def test_diff_of_an_unreadable_file_exits_2_naming_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    code, _, err = cli(capsys, "diff", str(bad), str(bad))
    assert code == 2 and str(bad) in err
    code, _, err = cli(capsys, "diff", str(tmp_path / "missing.json"), str(bad))
    assert code == 2 and "missing.json" in err


def test_fields_and_record_types_added_to_the_plan_round_trip_without_encoder_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a later change adds to the Plan's dataclasses (a flag on
    TensorParallel, a tuple of records of a new kind) is written and read
    by field, the new kind found by class name in the Plan's module."""
    module = "fsdptx.plan._types"
    record = dataclasses.make_dataclass("LaterRecord", [("module", str), ("takes", str), ("gives", str)], frozen=True)
    extended = dataclasses.make_dataclass(
        "TensorParallel",
        [
            ("later_flag", bool, dataclasses.field(default=False)),
            ("later_records", tuple, dataclasses.field(default=())),
        ],
        bases=(TensorParallel,),
        frozen=True,
    )
    record.__module__ = extended.__module__ = module  # as if defined there
    monkeypatch.setattr(plan_types, "LaterRecord", record, raising=False)
    monkeypatch.setattr(plan_types, "TensorParallel", extended)
    p = manager_plan(sequence_parallel=True)
    tp = p.tensor_parallel
    assert tp is not None
    records = (record("layers.0", "Shard(1)", "Shard(1)"), record("norm", "Shard(1)", "Replicate()"))
    existing = {f.name: getattr(tp, f.name) for f in dataclasses.fields(tp)}
    q = p.replace(tensor_parallel=extended(**existing, later_flag=True, later_records=records))
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(q))
    assert back == q
    assert back.tensor_parallel.later_flag is True  # type: ignore[union-attr]
    assert back.tensor_parallel.later_records == records  # type: ignore[union-attr]
    unflagged = q.replace(tensor_parallel=dataclasses.replace(q.tensor_parallel, later_flag=False))
    assert "tensor_parallel.later_flag: False -> True" in str(fsdptx.diff_plans(unflagged, q)).splitlines()
