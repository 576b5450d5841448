"""``plan --mesh pp=... --schedule Interleaved1F1B --batch B --seq S``: each
pipeline rank's step traced with all its stages, in torch's order for the rank.

A rank of an interleaved pipeline runs several stages, each an FSDP root of
its own, and holds what their forwards and backwards leave at once; the
dry run traces the rank, not the stages one by one, and checks itself
against the plain tracker run of the same rank (``rank_tracker_recipe``).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from fsdptx import FSDP2Config, PipelineParallelConfig
from fsdptx.cli._main import main
from fsdptx.plan._stages import interleaved_1f1b_actions
from rank_tracker_recipe import rank_tracker_peak
from test_cli_html import chromium, needs_chromium

SEQ = 512
DIM = 1024  # the llama preset's width
M = 4  # micro-batches
SHORT = ["--preset", "llama", "--layers", "4", "--batch", "4", "--seq", str(SEQ)]
PIPE = ["--schedule", "Interleaved1F1B", "--stages-per-rank", "2", "--microbatches", str(M)]


def _plan(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["plan", *argv])
    return code, out.getvalue(), err.getvalue()


def _json(*argv: str) -> dict[str, Any]:
    code, out, err = _plan(*argv, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


@pytest.fixture(scope="module")
def traced() -> dict[str, Any]:
    return _json(*SHORT, "--mesh", "pp=2,dp=1", *PIPE, "--mp", "bf16")


def test_each_rank_holds_at_most_the_micro_batches_its_order_keeps_at_once(traced: dict[str, Any]) -> None:
    for rank in traced["ranks"]:
        held = most = 0
        for kind, _, _ in interleaved_1f1b_actions(rank["rank"], 2, 2, M):
            held += 1 if kind == "F" else -1
            most = max(most, held)
        assert rank["memory"]["traced"]["in_flight_microbatches"] == most
    assert [r["memory"]["traced"]["in_flight_microbatches"] for r in traced["ranks"]] == [5, 3]


def test_each_stage_of_a_rank_receives_what_the_stage_before_it_hands_on(traced: dict[str, Any]) -> None:
    hidden = {"shape": [1, SEQ, DIM], "dtype": "bfloat16"}  # one sequence per micro-batch, the compute dtype
    rank0, rank1 = (r["memory"]["traced"] for r in traced["ranks"])
    assert (rank0["received"], rank0["sent"]) == ({"0": None, "2": hidden}, {"0": hidden, "2": hidden})
    assert (rank1["received"], rank1["sent"]) == ({"1": hidden, "3": hidden}, {"1": hidden, "3": None})
    one = SEQ * DIM * 2
    # torch's receive buffers: an input and an output gradient per micro-batch and stage, where the stage has them
    assert [r["memory"]["traced"]["p2p_buffer_bytes"] for r in traced["ranks"]] == [M * 3 * one, M * 3 * one]
    assert [r["memory"]["traced"]["input_grad_bytes"] for r in traced["ranks"]] == [M * one, M * 2 * one]


def test_the_peak_rank_is_named_with_the_stage_and_micro_batch_it_peaks_in(traced: dict[str, Any]) -> None:
    top = traced["memory"]
    worst = max(traced["ranks"], key=lambda r: r["memory"]["peak_bytes"])
    assert (top["pp_rank"], top["peak_bytes"]) == (worst["rank"], worst["memory"]["traced"]["peak_bytes"])
    assert sum(worst["memory"]["traced"]["peak_breakdown"].values()) == top["peak_bytes"]
    match = re.fullmatch(r"(forward|backward) of \S+, stage (\d), micro-batch \d", top["peak_at"])
    assert match, top["peak_at"]
    assert int(match[2]) == top["peak_stage"] and top["peak_stage"] in worst["stages"]
    assert all("traced" not in s["memory"] and "peak_bytes" not in s["memory"] for s in traced["stages"])


def test_the_text_prints_each_ranks_traced_figures_as_json_has_them() -> None:
    argv = (*SHORT, "--mesh", "pp=2,dp=1", *PIPE)
    code, out, err = _plan(*argv)
    assert code == 0, err
    data = _json(*argv)
    for rank in data["ranks"]:
        t = rank["memory"]["traced"]
        assert f"({t['peak_bytes']:,} B)  {t['peak_at']}" in out
    assert f"peak rank   {data['memory']['pp_rank']}: " in out


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("html") / "interleaved.html"
    code, _, err = _plan(*SHORT, "--mesh", "pp=2,dp=1", *PIPE, "--html", str(path))
    assert code == 0, err
    return path


def test_the_html_page_draws_each_ranks_stages_on_its_time_axis(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert "Pipeline rank 0 (stages 0, 2)" in text and "Pipeline rank 1 (stages 1, 3)" in text
    assert "forward of stage 2 of micro-batch 0" in text
    assert "receive the activations of micro-batch 0 from stage 1" in text  # stage 2's input, on rank 0


@needs_chromium
def test_the_interleaved_page_script_runs_without_a_javascript_error(page: Path) -> None:
    result = chromium("--dump-dom", page.as_uri())
    assert 'data-ready="1"' in result.stdout, "the page script did not finish"
    assert len(re.findall(r'class="readout">\d+ samples; point at the chart', result.stdout)) == 2  # one chart per rank
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console


@pytest.mark.parametrize("ac", [None, "full"])
def test_a_traced_rank_peaks_where_the_plain_tracker_run_of_its_stages_peaks(ac: str | None) -> None:
    """Against torch's MemTracker over the rank's stages built by
    ``FSDP2Manager.parallelize`` and run in torch's own ``pipeline_order``
    (two steps): to within 0.5%, on both ranks."""
    layers, seq = 4, 2048
    argv = ["--preset", "llama", "--layers", str(layers), "--batch", "4", "--seq", str(seq)]
    argv += ["--mesh", "pp=2,dp_shard=2", *PIPE, *([] if ac is None else ["--ac", ac])]
    data = _json(*argv)
    pipeline = PipelineParallelConfig(schedule="Interleaved1F1B", microbatches=M, stages_per_rank=2)
    config = FSDP2Config(pipeline_parallel=pipeline, **({} if ac is None else {"activation_checkpointing": ac}))
    for rank in data["ranks"]:
        tracked = rank_tracker_peak(layers, seq, (2, 2), ("pp", "dp_shard"), config, pp_rank=rank["rank"], hidden=(1, seq, DIM))
        assert abs(rank["memory"]["peak_bytes"] / tracked - 1) < 0.005, (rank["rank"], rank["memory"]["peak_bytes"], tracked)
