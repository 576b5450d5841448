"""``python -m fsdptx plan --mesh pp=...``: every pipeline stage, and its
memory per rank, in text and JSON; the pipeline options refused in one line
where they cannot apply."""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

import pytest
import torch

from fsdptx.cli._main import main
from fsdptx.model._index import ModelIndex
from fsdptx.plan._json import plan_from_json
from fsdptx.plan._stages import in_flight_microbatches
from fsdptx.presets import build_preset

SEQ = 64
DIM = 1024  # the llama preset's width


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("fsdptx: error: ") and len(err.splitlines()) == 1, err
    return err


# --------------------------------------------------------------------------- the stages


def test_a_pp_mesh_prints_every_stage_and_each_stages_memory_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=2,tp=2", "--sp", "--schedule", "1F1B", "--microbatches", "4")
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data = run_json(capsys, *argv)
    assert "pipeline: 2 stages on pp=2 (1 per rank, loop placement), schedule 1F1B, 4 micro-batches" in out
    assert "stage 0 (pp rank 0): embed_tokens, layers.{0..1}" in out
    assert "stage 1 (pp rank 1): layers.{2..3}, norm, lm_head" in out
    for stage in data["stages"]:
        m = stage["memory"]
        row = rf"^  {stage['index']}\s+{stage['rank']}\s+{m['params_bytes']:,} B\s+{m['grads_bytes']:,} B\s+{m['optimizer_bytes']:,} B\s"
        assert re.search(row, out, re.M), (row, out)


def test_each_stages_parameters_gradients_and_optimizer_state_are_its_rank_zero_shards_to_the_byte(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=2", "--optimizer", "sgd")
    with torch.device("meta"):
        params = ModelIndex.build(build_preset("llama", 4)).params
    for stage in data["stages"]:
        held = [p for f, p in params.items() if any(f == m or f.startswith(m + ".") for m in stage["modules"])]
        # fp32 storage; FSDP splits dim 0 over dp=2, rank 0 holding the rounded-up half
        local = sum(math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) for p in held)
        m = stage["memory"]
        assert (m["params_bytes"], m["grads_bytes"], m["optimizer_bytes"]) == (4 * local, 4 * local, 1 * 4 * local)
    assert [s["modules"] for s in data["stages"]] == [
        ["embed_tokens", "layers.0", "layers.1"],
        ["layers.2", "layers.3", "norm", "lm_head"],
    ]


def test_a_pp_mesh_without_a_schedule_runs_1f1b_with_one_micro_batch_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=2")
    assert {k: data["pipeline"][k] for k in ("schedule", "microbatches", "size", "stages_per_rank")} == {
        "schedule": "1F1B",
        "microbatches": 2,
        "size": 2,
        "stages_per_rank": 1,
    }
    assert data["dims"]["pp"] == 2 and data["units"] == []


def test_json_stages_carry_index_rank_modules_memory_and_the_stages_plan(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=2")
    for stage in data["stages"]:
        assert {"index", "rank", "modules", "units", "rows", "step", "memory"} <= set(stage)
        planned = data["plan"]["plan"]["pipeline"]["stages"][stage["index"]]
        assert (planned["index"], planned["rank"], planned["modules"]) == (stage["index"], stage["rank"], stage["modules"])
        assert [u["modules"] for u in stage["units"]] == [u["modules"] for u in planned["plan"]["units"]]
        m = stage["memory"]
        assert m["held_bytes"] == (
            m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"] + m["gathered_bytes"] + m["accumulated_grads_bytes"]
        )
        # nothing reshards under pipelining: every unit is gathered once and reduced once per step
        assert stage["step"]["all_gathers"] == stage["step"]["reduce_scatters"] == len(stage["units"])
    assert [r["stages"] for r in data["ranks"]] == [[0], [1]]
    assert data["memory"]["pp_rank"] in (0, 1)


def test_stages_per_rank_puts_several_stages_on_each_rank_and_sums_their_memory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2")
    data = run_json(capsys, *argv)
    assert [(s["index"], s["rank"]) for s in data["stages"]] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    for r in data["ranks"]:
        mine = [s for s in data["stages"] if s["rank"] == r["rank"]]
        assert r["memory"]["params_bytes"] == sum(s["memory"]["params_bytes"] for s in mine)
    code, out, _ = run(capsys, *argv)
    assert code == 0 and "pp rank 0 (stages 0, 2): parameters" in out


def test_layers_per_stage_sets_the_blocks_of_the_middle_stages(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "6", "--mesh", "pp=3,dp=1", "--layers-per-stage", "3")
    blocks = [[m for m in s["modules"] if m.startswith("layers.")] for s in data["stages"]]
    assert [len(b) for b in blocks] == [2, 3, 1]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "flag", [("--schedule", "GPipe"), ("--microbatches", "4"), ("--stages-per-rank", "2"), ("--layers-per-stage", "2")]
)
def test_pipeline_options_without_a_pp_axis_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], flag: tuple[str, str]
) -> None:
    err = refused(capsys, "--preset", "llama", "--layers", "2", "--mesh", "dp=2", *flag)
    assert f"{flag[0]} apply to a --mesh with a pp axis" in err


def test_pipeline_options_fit_does_not_search_are_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--preset", "llama", "--layers", "2", "--fit", "8x80GiB", "--layers-per-stage", "1")
    assert "--layers-per-stage apply to a --mesh with a pp axis; --fit's pipeline candidates split the blocks evenly" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--mesh", "pp=2,dp=1", "--schedule", "ZigZag"), "unknown schedule 'ZigZag'"),
        (("--mesh", "pp=2,dp=1", "--schedule", "Interleaved1F1B"), "give stages-per-rank >= 2"),
        (("--mesh", "pp=2,dp=1", "--stages-per-rank", "2"), "runs one stage per rank"),
        (("--mesh", "pp=2,dp=1", "--microbatches", "0"), "--microbatches must be >= 1"),
        (("--mesh", "pp=4,dp=1"), "2 blocks cannot fill 4 stages"),
        (("--layers", "4", "--mesh", "pp=3,dp=1", "--layers-per-stage", "1"), "layers_per_stage=1 over 3 stages does not fit 4 blocks"),
        (("--mesh", "pp=2,dp=2", "--moe-mesh", "dp=4"), "--moe-mesh with a pp axis"),
        (("--mesh", "pp=2,tp=2"), "has no data-parallel axis"),
    ],
)
def test_a_pipeline_that_cannot_be_planned_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str
) -> None:
    assert says in refused(capsys, "--preset", "llama", "--layers", "2", *argv)


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_at_planning_as_torch_would(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--preset", "llama", "--layers", "4", "--mesh", "pp=4,dp=1", "--microbatches", "2")
    assert "schedule '1F1B' needs at least one micro-batch per stage, got microbatches=2 for 4 stages" in err


def test_a_batch_the_micro_batches_do_not_split_is_refused_before_tracing(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--preset", "llama", "--layers", "2", "--mesh", "pp=2,dp=1", "--microbatches", "2", "--batch", "3")
    assert "--batch 3 does not split into 2 micro-batches" in err


def test_without_batch_each_micro_batch_is_one_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "pp=2,dp=1", "--microbatches", "3", "--seq", "32")
    assert data["pipeline"]["microbatch"] == 1
    assert [s["memory"]["received"] for s in data["stages"]] == [None, {"shape": [1, 32, DIM], "dtype": "bfloat16"}]


def test_tracing_a_schedule_the_dry_run_does_not_trace_is_refused_with_the_shape_only_way_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = refused(
        capsys, "--preset", "llama", "--layers", "4", "--mesh", "pp=2,dp=1", "--schedule", "LoopedBFS",
        "--stages-per-rank", "2", "--seq", "64",
    )
    assert "the schedules 1F1B, GPipe, Interleaved1F1B, not LoopedBFS; drop them for the exact shape-only figures" in err


# --------------------------------------------------------------------------- the traced step


@pytest.fixture(scope="module")
def traced_1f1b() -> dict[str, Any]:
    return _traced("1F1B")


def _traced(schedule: str) -> dict[str, Any]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", "--preset", "llama", "--layers", "3", "--mesh", "pp=3,dp=1", "--schedule", schedule]
    argv += ["--microbatches", "4", "--batch", "4", "--seq", str(SEQ), "--mp", "bf16", "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    data: dict[str, Any] = json.loads(out.getvalue())
    return data


def test_a_1f1b_stage_holds_the_activations_of_its_micro_batches_in_flight(traced_1f1b: dict[str, Any]) -> None:
    stages = traced_1f1b["stages"]
    assert [s["memory"]["in_flight_microbatches"] for s in stages] == [3, 2, 1]
    for s in stages:
        m = s["memory"]
        assert m["in_flight_microbatches"] == in_flight_microbatches("1F1B", s["index"], 3, 4)
        assert m["activations_bytes"] == m["in_flight_microbatches"] * m["activations_per_microbatch_bytes"]


def test_a_gpipe_stage_holds_the_activations_of_every_micro_batch() -> None:
    for s in _traced("GPipe")["stages"]:
        m = s["memory"]
        assert m["in_flight_microbatches"] == 4
        assert m["activations_bytes"] == 4 * m["activations_per_microbatch_bytes"]


def test_p2p_buffers_hold_every_micro_batchs_input_and_output_gradient(traced_1f1b: dict[str, Any]) -> None:
    stages = traced_1f1b["stages"]
    hidden = {"shape": [1, SEQ, DIM], "dtype": "bfloat16"}  # one sequence per micro-batch, the compute dtype
    assert [(s["memory"]["received"], s["memory"]["sent"]) for s in stages] == [
        (None, hidden),
        (hidden, hidden),
        (hidden, None),
    ]
    one = SEQ * DIM * 2
    assert [s["memory"]["p2p_buffer_bytes"] for s in stages] == [4 * one, 8 * one, 4 * one]
    assert [s["memory"]["input_grad_bytes"] for s in stages] == [0, 4 * one, 4 * one]


def test_the_peak_stage_is_named_with_where_it_peaks(traced_1f1b: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    stages, top = traced_1f1b["stages"], traced_1f1b["memory"]
    worst = max(stages, key=lambda s: s["memory"]["peak_bytes"])
    assert (top["peak_stage"], top["pp_rank"], top["peak_bytes"]) == (worst["index"], worst["rank"], worst["memory"]["peak_bytes"])
    assert sum(worst["memory"]["peak_breakdown"].values()) == top["peak_bytes"]
    assert re.fullmatch(r"(forward|backward) of \S+, micro-batch \d|reduce_grad|tp_sync|optimizer step", top["peak_at"])


def test_the_text_prints_each_stages_traced_figures_as_json_has_them(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--preset", "llama", "--layers", "2", "--mesh", "pp=2,dp=1", "--microbatches", "2", "--batch", "2", "--seq", str(SEQ))
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    data = run_json(capsys, *argv)
    for s in data["stages"]:
        assert f"({s['memory']['peak_bytes']:,} B)  {s['memory']['peak_at']}" in out
    top = data["memory"]
    assert f"peak stage  {top['peak_stage']} on pp rank {top['pp_rank']}" in out


# --------------------------------------------------------------------------- speed


def test_a_70b_shaped_model_on_a_pp_mesh_plans_and_applies_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    shape = "num_hidden_layers=80,hidden_size=8192,intermediate_size=28672,num_attention_heads=64,num_key_value_heads=8"
    start = time.perf_counter()
    data = run_json(capsys, "--hf", "llama", "--hf-config", shape, "--mesh", "pp=8,dp=8")
    elapsed = time.perf_counter() - start
    assert data["applied"] == "full" and len(data["stages"]) == 8
    assert sum(s["memory"]["params_bytes"] for s in data["stages"]) * 8 == data["model_bytes"]  # bf16, no padding
    assert elapsed < 30, f"70B pipelined dry run took {elapsed:.1f} s"


def test_the_json_plan_is_the_pipelined_plan_in_plan_to_jsons_schema(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdptx.manager import FSDP2Config, FSDP2Manager, PipelineParallelConfig
    from fsdptx.testing import fake_mesh

    data = run_json(capsys, "--preset", "llama", "--layers", "2", "--mesh", "pp=2,dp=2", "--mp", "none")
    with torch.device("meta"):
        model = build_preset("llama", 2)
    with fake_mesh((2, 2), ("pp", "dp")) as mesh:
        planned = FSDP2Manager(FSDP2Config(mp_policy=None, pipeline_parallel=PipelineParallelConfig()), mesh).plan(model)
    assert plan_from_json(json.dumps(data["plan"])) == planned
