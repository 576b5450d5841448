"""The traced step runs the layouts a training loop runs: vocabulary-sharded
logits under ``loss_parallel``, tensor parallelism on one data-parallel
rank, and the titan preset at the dry run's default sequence length."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import fsdptx
from fsdptx.cli._main import main
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import Titan, TitanConfig, build_preset
from fsdptx.testing import fake_mesh

SEQ, VOCAB = 256, 32000  # the llama preset's vocabulary


def _memory(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["memory"]  # type: ignore[no-any-return]


def _estimate(config: FSDP2Config, shape: tuple[int, ...], names: tuple[str, ...]) -> fsdptx.MemoryEstimate:
    with torch.device("meta"):
        model = build_preset("llama", 2)
    with fake_mesh(shape, names) as mesh:
        return fsdptx.estimate_memory(FSDP2Manager(config, mesh), model, batch=1, seq=SEQ)


def test_loss_parallel_traces_and_keeps_only_this_ranks_vocabulary_slice_of_the_fp32_logits() -> None:
    whole = _estimate(FSDP2Config(sequence_parallel=True), (2, 2), ("dp", "tp"))
    sharded = _estimate(FSDP2Config(sequence_parallel=True, loss_parallel=True), (2, 2), ("dp", "tp"))
    # the loss's fp32 logits, saved for backward: whole on each TP rank, or half of them
    assert whole.activations_bytes - sharded.activations_bytes == SEQ * VOCAB * 4 // 2
    gathered = {c.op for c in sharded.collectives if c.source == "tp"}
    assert "all_reduce" in gathered  # the cross entropy's max and sum over the vocabulary slices


def test_loss_parallel_traces_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("--preset", "llama", "--layers", "2", "--seq", str(SEQ), "--mesh", "dp=2,tp=2", "--sp")
    whole = _memory(capsys, *argv)
    sharded = _memory(capsys, *argv, "--loss-parallel")
    assert whole["activations_bytes"] - sharded["activations_bytes"] == SEQ * VOCAB * 4 // 2


@pytest.mark.parametrize("extra", [(), ("--sp",)], ids=["tp", "tp-sp"])
def test_tensor_parallelism_on_one_data_parallel_rank_traces(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...]
) -> None:
    argv = ("--preset", "llama", "--layers", "2", "--mesh", "dp=1,tp=2", *extra)
    traced = _memory(capsys, *argv, "--seq", "64")
    shapes = _memory(capsys, *argv)
    assert traced["params_bytes"] == shapes["params_bytes"]  # every parameter TP-split or whole, none FSDP-split
    assert traced["peak_bytes"] > traced["params_bytes"] + traced["activations_bytes"]


def test_estimate_memory_traces_tensor_parallelism_on_one_data_parallel_rank() -> None:
    estimate = _estimate(FSDP2Config(sequence_parallel=True), (1, 2), ("dp", "tp"))
    assert estimate.activations_bytes > 0 and estimate.peak_bytes > estimate.params_bytes


def test_the_titan_preset_traces_at_the_default_sequence_length(capsys: pytest.CaptureFixture[str]) -> None:
    memory = _memory(capsys, "--preset", "titan", "--layers", "1", "--mesh", "dp=2", "--batch", "1")
    assert memory["seq"] == 2048 and memory["activations_bytes"] > 0


def test_a_sequence_longer_than_titans_rotary_tables_is_refused_with_the_limit() -> None:
    model = Titan(TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=1, max_seq_len=16))
    with pytest.raises(ValueError, match="sequence of 17 tokens is longer than its rotary tables .16 positions."):
        model(torch.zeros(1, 17, dtype=torch.long))
    assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 64)
