"""A pipelined Plan is data like any other: it prints its stages, reads back
equal from JSON, diffs stage by stage, and the snapshot check sees a
change inside one stage."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdptx
from fsdptx.cli._main import main
from fsdptx.plan._plan import Plan
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh
from fsdptx.testing.plugin import check_plan_snapshot

CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=4)


def meta_model() -> Decoder:
    with torch.device("meta"):
        return Decoder(CFG)


def staged_plan(*, sp: bool = True, **pipeline: Any) -> Plan:
    config = fsdptx.FSDP2Config(
        sequence_parallel=sp, pipeline_parallel=fsdptx.PipelineParallelConfig(**{"microbatches": 4, **pipeline})
    )
    with fake_mesh((2, 2, 2), ("pp", "dp", "tp")) as mesh:
        return fsdptx.FSDP2Manager(config, mesh).plan(meta_model())


def test_str_of_a_pipelined_plan_shows_the_stage_table_then_each_stages_units() -> None:
    text = str(staged_plan())
    lines = text.splitlines()
    assert lines[0] == "pipeline: 2 stages on pp=2 (1 per rank, loop placement), schedule 1F1B, 4 micro-batches"
    assert any(line.startswith("0      0        embed_tokens, layers.{0..1}") for line in lines), text
    assert any(line.startswith("1      1        layers.{2..3}, norm, lm_head") for line in lines), text
    assert "stage 0 (pp rank 0): embed_tokens, layers.{0..1}" in lines
    assert "stage 1 (pp rank 1): layers.{2..3}, norm, lm_head" in lines
    # Each stage's own units follow its heading: the blocks it holds and its root.
    stage1 = text.split("stage 1 (pp rank 1)")[1]
    assert "block  layers.2" in stage1 and "block  layers.3" in stage1 and "layers.0" not in stage1
    assert "<next pipeline stage>" in text.split("stage 1 (pp rank 1)")[0]  # stage 0 hands its shard on


def test_a_pipelined_plan_reads_back_equal_from_json() -> None:
    p = staged_plan()
    back = fsdptx.plan_from_json(fsdptx.plan_to_json(p))
    assert back == p
    assert back.pipeline is not None and p.pipeline is not None
    assert [s.modules for s in back.pipeline.stages] == [s.modules for s in p.pipeline.stages]
    assert str(back) == str(p)


def test_diff_names_the_pipeline_field_that_changed() -> None:
    a, b = staged_plan(), staged_plan(microbatches=8)
    assert not fsdptx.diff_plans(a, a)
    diff = fsdptx.diff_plans(a, b)
    assert diff
    assert "pipeline.microbatches: 4 -> 8" in str(diff)


def test_diff_sees_a_change_inside_one_stage() -> None:
    a = staged_plan()
    assert a.pipeline is not None
    stage = a.pipeline.stages[1]
    units = tuple(dataclasses.replace(u, reshard_after_forward=True) if u.kind == "block" else u for u in stage.plan.units)
    changed = dataclasses.replace(stage, plan=stage.plan.replace(units=units))
    b = a.replace(pipeline=dataclasses.replace(a.pipeline, stages=(a.pipeline.stages[0], changed)))
    diff = str(fsdptx.diff_plans(a, b))
    assert "stages" in diff and "reshard_after_forward" in diff, diff


def test_the_cli_diff_of_two_pipelined_plan_files_exits_1_naming_the_change(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.json").write_text(fsdptx.plan_to_json(staged_plan()))
    (tmp_path / "b.json").write_text(fsdptx.plan_to_json(staged_plan(microbatches=8)))
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "pipeline.microbatches: 4 -> 8" in capsys.readouterr().out


def test_a_plan_snapshot_fails_when_a_stage_changes(tmp_path: Path) -> None:
    path = tmp_path / "staged.json"
    check_plan_snapshot(staged_plan(), path, update=True)
    check_plan_snapshot(staged_plan(), path, update=False)  # unchanged: passes
    with pytest.raises(pytest.fail.Exception, match="differs from its snapshot"):
        check_plan_snapshot(staged_plan(stages_per_rank=2, schedule="Interleaved1F1B"), path, update=False)
