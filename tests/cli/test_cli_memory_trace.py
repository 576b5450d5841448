"""``python -m fsdptx plan --batch B --seq S``: the traced step in the report.

Every figure the text report prints is in ``--json`` too, the traced figures
sit under ``"memory"``, and an HF model plans with selective checkpointing
(the dry run turns the KV cache off on the model it builds, as training must).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.core._sizes import format_bytes

SMALL = ("--preset", "llama", "--layers", "2", "--seq", "128")
BYTES = re.compile(r"\d+(?:\.\d+)? (?:GiB|MiB|KiB)|\b[\d,]+ B\b")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def figures(value: Any) -> set[str]:
    """Every byte figure in ``value``: its numbers formatted both ways the
    report prints them, and figures inside its strings (notes)."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {format_bytes(value), f"{value:,} B"}
    if isinstance(value, str):
        return set(BYTES.findall(value))
    if isinstance(value, dict):
        return set().union(*map(figures, value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*map(figures, value)) if value else set()
    return set()


@pytest.mark.parametrize(
    "extra",
    [(), ("--mesh", "dp=2,tp=2", "--sp"), ("--ac", "full"), ("--mesh", "cp=2,dp=2")],
    ids=["dp8", "dp2xtp2-sp", "ac-full", "cp2xdp2"],
)
def test_json_carries_every_byte_figure_of_the_text_report(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    text = run(capsys, *SMALL, *extra)
    data = json.loads(run(capsys, *SMALL, *extra, "--json"))
    shown = figures(data)
    printed = BYTES.findall(text)
    assert printed, "the report prints byte figures"
    missing = [f for f in printed if f not in shown]
    assert not missing, f"printed but not in --json: {missing}"


def test_traced_figures_sit_under_memory(capsys: pytest.CaptureFixture[str]) -> None:
    m = json.loads(run(capsys, *SMALL, "--json"))["memory"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes", "peak_at"):
        assert key in m, key
    assert (m["batch"], m["seq"]) == (1, 128)
    assert m["peak_bytes"] == sum(m["peak_breakdown"].values())
    assert m["peak_bytes"] > m["params_bytes"] + m["activations_bytes"]


def test_without_batch_or_seq_nothing_is_traced(capsys: pytest.CaptureFixture[str]) -> None:
    m = json.loads(run(capsys, "--preset", "llama", "--layers", "1", "--json"))["memory"]
    assert "peak_bytes" not in m and "activations_bytes" not in m


def test_longer_sequences_save_more_activations(capsys: pytest.CaptureFixture[str]) -> None:
    short = json.loads(run(capsys, *SMALL, "--json"))["memory"]["activations_bytes"]
    long = json.loads(run(capsys, "--preset", "llama", "--layers", "2", "--seq", "256", "--json"))["memory"]
    assert long["activations_bytes"] > 1.8 * short


def test_offload_leaves_the_sharded_parts_out_of_the_device_peak(capsys: pytest.CaptureFixture[str]) -> None:
    on = json.loads(run(capsys, *SMALL, "--offload", "--json"))["memory"]
    off = json.loads(run(capsys, *SMALL, "--json"))["memory"]
    assert on["peak_bytes"] < off["peak_bytes"]
    assert any("offload" in note for note in on["estimated"])


def test_an_hf_model_traces_with_selective_checkpointing(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    overrides = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,vocab_size=256"
    argv = ("--hf", "llama", "--hf-config", overrides, "--seq", "64", "--mesh", "dp=2", "--json")
    plain = json.loads(run(capsys, *argv))["memory"]
    selective = json.loads(run(capsys, *argv, "--ac", "selective"))["memory"]
    assert selective["activations_bytes"] < plain["activations_bytes"]


def test_a_bad_sequence_length_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama", "--layers", "1", "--seq", "0"]) == 2
    assert "--seq must be >= 1" in capsys.readouterr().err
