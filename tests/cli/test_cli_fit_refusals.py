"""``--fit`` refuses, in one line with exit code 2 and before building
anything, a world it cannot simulate, memory it cannot fit into and an
``--html`` it would not draw; a TP size that does not divide ``--seq`` is
skipped and listed, not fatal to the search, and so is a TP size whose
plan the model refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdptx.cli import _fit, _run
from fsdptx.cli._common import MAX_WORLD
from fsdptx.cli._main import main

MODEL = ("plan", "--preset", "llama", "--layers", "2", "--seq", "64")


@pytest.fixture
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the model is built or a mesh enumerated."""

    def fail(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the refusal came after work began")

    monkeypatch.setattr(_run, "build_model", fail)
    monkeypatch.setattr(_fit, "meshes", fail)


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main([*MODEL, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("gpus", [MAX_WORLD + 1, 99_999_999_999])
@pytest.mark.usefixtures("nothing_built")
def test_a_world_over_the_rank_limit_is_refused_up_front(capsys: pytest.CaptureFixture[str], gpus: int) -> None:
    err = _refused(capsys, "--fit", f"{gpus}x80GiB")
    assert f"{gpus:,} GPUs" in err and f"at most {MAX_WORLD:,}" in err


@pytest.mark.parametrize("memory", ["0GiB", "0.1B", "0B"])
@pytest.mark.usefixtures("nothing_built")
def test_no_memory_per_gpu_is_refused(capsys: pytest.CaptureFixture[str], memory: str) -> None:
    err = _refused(capsys, "--fit", f"8x{memory}")
    assert "memory per GPU must be at least 1 byte" in err


@pytest.mark.usefixtures("nothing_built")
def test_no_gpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert "at least 1" in _refused(capsys, "--fit", "0x80GiB")


@pytest.mark.usefixtures("nothing_built")
def test_html_with_fit_is_refused_and_writes_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    page = tmp_path / "step.html"
    err = _refused(capsys, "--fit", "8x80GiB", "--html", str(page))
    assert "--html" in err and "--fit" in err
    assert not page.exists()


def test_a_tp_size_that_does_not_divide_seq_is_skipped_and_the_search_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "--preset", "llama", "--layers", "1", "--seq", "6", "--fit", "8x80GiB", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    fit = json.loads(out)["fit"]
    assert any(s.startswith("tp=4: --seq 6 is not divisible by 4") for s in fit["skipped"]), fit["skipped"]
    evaluated = [c["mesh"] for c in fit["fitting"] + fit["not_fitting"]]
    assert {"dp_shard": 8} in evaluated
    assert not any(m.get("tp") == 4 for m in evaluated)


def test_a_tp_size_whose_plan_the_model_refuses_is_listed_once_in_its_place_and_the_search_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shape = "num_hidden_layers=1,hidden_size=96,intermediate_size=192,num_attention_heads=6,num_key_value_heads=6,vocab_size=256"
    code = main(["plan", "--hf", "llama", "--hf-config", shape, "--seq", "60", "--fit", "16x80GiB", "--fit-cp", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    fit = json.loads(out)["fit"]
    about = [s.split(":")[0] for s in fit["skipped"]]
    assert about == ["tp=2, cp=2", "tp=4", "tp=4, cp=2", "tp=8", "tp=8, cp=2"], fit["skipped"]  # the order tp sizes are met in
    assert "num_attention_heads=6 is not divisible by tp=4" in fit["skipped"][1]
    evaluated = [c["mesh"] for c in fit["fitting"] + fit["not_fitting"]]
    assert not any(m.get("tp") == 4 for m in evaluated)
    assert any(m.get("tp") == 2 for m in evaluated) and any(m.get("cp") == 2 for m in evaluated)
