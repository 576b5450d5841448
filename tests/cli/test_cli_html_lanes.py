"""``--html`` under context and pipeline parallelism: ring attention's
rotations (modelled, said so) on the time axis of a ``cp`` mesh, and one
chart per pipeline stage with its schedule and point-to-point transfers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fsdptx.cli._main import main

from test_cli_html import chromium, needs_chromium, parsed

PP_ARGV = ("--preset", "llama", "--layers", "2", "--seq", "64", "--mesh", "pp=2,dp=1", "--microbatches", "2")


def _titles(text: str) -> list[str]:
    return re.findall(r"<title>([^<]*)</title>", text)


def test_a_cp_page_shows_each_attention_layers_ring_rotation_as_modelled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cp.html"
    assert main(["plan", "--preset", "llama", "--layers", "2", "--seq", "256", "--mesh", "cp=2,dp=2", "--html", str(path)]) == 0
    text = path.read_text(encoding="utf-8")
    assert "cp ring (modelled, allgather)" in text
    rotations = [t for t in _titles(text) if "ring attention receives" in t]
    assert len(rotations) == 4, rotations  # 2 attention layers, forward and backward
    assert all("modelled, not traced" in t and "cp=2" in t for t in rotations)
    assert sum("(forward)" in t for t in rotations) == sum("(backward)" in t for t in rotations) == 2


def test_a_page_without_cp_has_no_ring_lane(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "dp.html"
    assert main(["plan", "--preset", "llama", "--layers", "2", "--seq", "64", "--mesh", "dp=2", "--html", str(path)]) == 0
    assert "cp ring" not in path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def pipeline_page(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    path = tmp_path_factory.mktemp("pp") / "pp.html"
    assert main(["plan", *PP_ARGV, "--html", str(path)]) == 0
    return path, {}


def test_a_pipeline_page_draws_every_stage_with_its_schedule(
    capsys: pytest.CaptureFixture[str], pipeline_page: tuple[Path, dict[str, object]]
) -> None:
    path, _ = pipeline_page
    tags = parsed(path).tags
    assert [a.get("id") for t, a in tags if t == "svg"] == ["step0", "step1"]
    text = path.read_text(encoding="utf-8")
    titles = _titles(text)
    # 1F1B with 2 micro-batches: each stage runs F0, F1, B0, B1 in some order
    for mb in (0, 1):
        assert titles.count(f"forward of micro-batch {mb}") == 2
        assert titles.count(f"backward of micro-batch {mb}") == 2


def test_a_pipeline_page_shows_the_point_to_point_transfers_of_each_micro_batch(
    capsys: pytest.CaptureFixture[str], pipeline_page: tuple[Path, dict[str, object]]
) -> None:
    path, _ = pipeline_page
    assert main(["plan", *PP_ARGV, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    titles = _titles(path.read_text(encoding="utf-8"))
    sends = [t for t in titles if t.startswith("send the activations")]
    receives = [t for t in titles if t.startswith("receive the activations")]
    grads_out = [t for t in titles if t.startswith("send the gradient")]
    grads_in = [t for t in titles if t.startswith("receive the gradient")]
    assert len(sends) == len(receives) == len(grads_out) == len(grads_in) == 2  # one per micro-batch each way
    assert all("to stage 1" in t for t in sends) and all("from stage 0" in t for t in receives)
    assert all("from stage 1" in t for t in grads_in) and all("to stage 0" in t for t in grads_out)
    assert len({t.rsplit(": ", 1)[1] for t in sends + receives + grads_in + grads_out}) == 1  # the same tensor each way
    peak = data["memory"]["peak_stage"]
    assert f"Stage {peak} (pp rank {peak}) &mdash; the peak" in path.read_text(encoding="utf-8")


def test_html_of_an_untraced_pipeline_schedule_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        ["plan", "--preset", "llama", "--layers", "4", "--seq", "64", "--mesh", "pp=2,dp=1", "--schedule", "LoopedBFS",
         "--stages-per-rank", "2", "--html", str(tmp_path / "x.html")]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not LoopedBFS" in err
    assert not (tmp_path / "x.html").exists()


@needs_chromium
def test_the_pipeline_page_script_runs_without_a_javascript_error(pipeline_page: tuple[Path, dict[str, object]]) -> None:
    path, _ = pipeline_page
    result = chromium("--dump-dom", path.as_uri())
    assert 'data-ready="1"' in result.stdout, "the page script did not finish"
    assert len(re.findall(r'class="readout">\d+ samples; point at the chart', result.stdout)) == 2  # both charts wired
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
