"""Context parallelism in the traced step (``--mesh cp=N,...``).

A CP rank's step is traced at ``seq / cp`` tokens, and ring attention's K/V
rotation buffers, which have no CPU kernel to trace, are added from their
closed form; the report says they are modelled. The closed forms here are
written out from the presets' dimensions by hand.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import fsdptx
from fsdptx.cli._main import main
from fsdptx.cli._scaling import rescale, traced_steady
from fsdptx.cli._trace import RING_BUFFERS, Trace
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

LLAMA = ("--preset", "llama", "--layers", "2")


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    memory: dict[str, Any] = json.loads(out)["memory"]
    return memory


def estimate(shape: tuple[int, ...], names: tuple[str, ...], seq: int, **kwargs: Any) -> fsdptx.MemoryEstimate:
    with torch.device("meta"):
        model = build_preset("llama", 2)
    with fake_mesh(shape, names) as mesh:
        return fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh), model, batch=1, seq=seq, **kwargs)


def test_a_cp_step_is_the_plain_step_at_seq_over_cp_plus_the_ring_buffers() -> None:
    cp = estimate((2, 2), ("dp", "cp"), 256)
    plain = estimate((4,), ("dp",), 128)  # the same shards (dp x cp = 4), half the sequence
    ring = cp.context_parallel
    assert ring is not None and ring.seq_per_rank == 128
    assert cp.activations_bytes == plain.activations_bytes  # ring buffers are freed, not saved for backward
    assert (cp.params_bytes, cp.grads_bytes, cp.optimizer_bytes) == (
        plain.params_bytes,
        plain.grads_bytes,
        plain.optimizer_bytes,
    )
    assert len(cp.timeline) == len(plain.timeline)
    added = set()
    for a, b in zip(cp.timeline, plain.timeline):
        extra = a.bytes.get(RING_BUFFERS, 0)
        assert {k: v for k, v in a.bytes.items() if k != RING_BUFFERS} == dict(b.bytes)
        if a.phase == "forward" and a.unit.startswith("layers."):
            assert extra == ring.kv_buffer_bytes
        elif a.phase == "backward" and a.unit.startswith("layers."):
            assert extra == ring.kv_buffer_bytes + ring.grad_kv_buffer_bytes
        else:
            assert extra == 0
        added.add(extra)
    assert len(added) == 3, "the blocks' forward and backward samples carry the buffers, the rest none"
    # The peak is the plain step's samples, sized to the exact shards as the estimate sizes them, plus the buffers.
    trace = Trace(plain.timeline, plain.collectives, plain.activations_bytes, (1, 128))
    exact = (plain.params_bytes, plain.grads_bytes, plain.optimizer_bytes)
    with_buffers = Trace(cp.timeline, cp.collectives, cp.activations_bytes, (1, 256))
    assert plain.peak_bytes == rescale(trace, traced=traced_steady(trace), target=exact)[0]
    assert cp.peak_bytes == rescale(with_buffers, traced=traced_steady(trace), target=exact)[0] >= plain.peak_bytes


def test_a_pipelined_cp_stage_is_the_stage_at_seq_over_cp_plus_the_ring_buffers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def stages(*argv: str) -> list[dict[str, Any]]:
        code = main(["plan", *LLAMA, "--schedule", "1F1B", "--microbatches", "2", "--batch", "2", *argv, "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        return [s["memory"] for s in json.loads(out)["stages"]]

    cp = stages("--mesh", "pp=2,dp=2,cp=2", "--seq", "512")
    plain = stages("--mesh", "pp=2,dp=4", "--seq", "256")  # the same shards (dp x cp = 4), half the sequence
    for a, b in zip(cp, plain, strict=True):
        ring = a["context_parallel"]
        assert ring is not None and ring["seq_per_rank"] == 256 and b["context_parallel"] is None
        for key in ("activations_bytes", "activations_per_microbatch_bytes", "p2p_buffer_bytes", "params_bytes", "optimizer_bytes"):
            assert a[key] == b[key], key
        extra = a["peak_breakdown"].get(RING_BUFFERS, 0)
        assert extra in (0, ring["kv_buffer_bytes"], ring["kv_buffer_bytes"] + ring["grad_kv_buffer_bytes"])
        assert a["peak_bytes"] - extra == sum(v for k, v in a["peak_breakdown"].items() if k != RING_BUFFERS)
        assert a["peak_bytes"] >= b["peak_bytes"]
        assert any("ring attention" in note for note in a["estimated"])


def test_cp_ranks_hold_fewer_activations_than_one_rank_with_the_whole_sequence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cp = plan_json(capsys, *LLAMA, "--mesh", "cp=2,dp=2", "--seq", "512")
    whole = plan_json(capsys, *LLAMA, "--mesh", "dp=4", "--seq", "512")
    assert cp["activations_bytes"] < 0.6 * whole["activations_bytes"]
    assert cp["peak_bytes"] < whole["peak_bytes"]
    assert (cp["seq"], whole["seq"]) == (512, 512)


def test_the_kv_buffer_is_the_closed_form_of_the_presets_dims(capsys: pytest.CaptureFixture[str]) -> None:
    # titan: n_kv_heads 8 x head_dim 16 (GQA, dim 256 over 16 heads), bf16 compute; batch 2, seq 1024, cp 2.
    m = plan_json(capsys, "--preset", "titan", "--layers", "2", "--mesh", "cp=2,dp=2", "--batch", "2", "--seq", "1024")
    ring = m["context_parallel"]
    assert ring["kv_buffer_bytes"] == 2 * 2 * 1024 * 8 * 16 * 2  # K and V of the whole sequence
    assert ring["grad_kv_buffer_bytes"] == 2 * (2 * 2 * 512 * 8 * 16) * 4  # two fp32 dK/dV chunks of seq/cp
    assert (ring["seq_per_rank"], ring["attention_layers"]) == (512, 2)
    # llama under TP: k_proj and v_proj (1024 wide) split colwise over tp=2, bf16; batch 1, seq 1024.
    m = plan_json(capsys, *LLAMA, "--mesh", "cp=2,dp=2,tp=2", "--sp", "--seq", "1024")
    assert m["context_parallel"]["kv_buffer_bytes"] == 2 * 1 * 1024 * (1024 // 2) * 2


def test_alltoall_rotation_holds_less_than_allgather_beyond_two_cp_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    def ring(cp: int, rotate: str) -> dict[str, Any]:
        argv = (*LLAMA, "--mesh", f"cp={cp},dp=1", "--seq", "1024", "--cp-rotate", rotate)
        out: dict[str, Any] = plan_json(capsys, *argv)["context_parallel"]
        return out

    gather, a2a = ring(4, "allgather"), ring(4, "alltoall")
    assert a2a["kv_buffer_bytes"] == gather["kv_buffer_bytes"] // 2  # two chunks of seq/4 against seq
    assert (gather["rotate_method"], a2a["rotate_method"]) == ("allgather", "alltoall")
    assert ring(2, "alltoall")["kv_buffer_bytes"] == ring(2, "allgather")["kv_buffer_bytes"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("--mesh", "cp=2,dp=2", "--seq", "1022"), "--seq 1022 with cp=2: seq=1022 is not divisible by 4"),
        (
            ("--mesh", "cp=2,dp=1,tp=2", "--sp", "--seq", "1028"),
            "seq=1028 is not divisible by 8 (2 x cp = 4 head-tail load-balancing chunks, each rank's seq/cp "
            "split over tp=2 by sequence parallelism); use a multiple of 8 such as 1024",
        ),
        (("--mesh", "dp=4", "--seq", "1024", "--cp-rotate", "alltoall"), "--cp-rotate sizes ring attention's buffers"),
        (("--mesh", "cp=2,dp=2", "--cp-rotate", "alltoall"), "it needs a cp axis > 1 in --mesh and --batch/--seq"),
        (("--mesh", "pp=2,cp=2,dp=1", "--seq", "1022"), "--seq 1022 with cp=2: seq=1022 is not divisible by 4"),
    ],
    ids=["head-tail", "sp", "rotate-without-cp", "rotate-without-trace", "pipelined"],
)
def test_a_cp_step_that_cannot_be_sized_is_refused_before_anything_is_built(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], expected: str
) -> None:
    def not_built(*args: object) -> None:
        raise AssertionError("the model was built, so a trace could start")

    monkeypatch.setattr("fsdptx.cli._main.build_model", not_built)
    assert main(["plan", *LLAMA, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and expected in err, err


def test_the_report_says_ring_attention_is_modelled_with_its_rotation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", *LLAMA, "--mesh", "cp=2,dp=2", "--seq", "256", "--cp-rotate", "alltoall"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "ring attention modelled (alltoall rotation)" in text
    assert "context parallelism: modelled, not traced" in text
    assert "seq/cp = 128 per CP rank" in text
    m = plan_json(capsys, *argv[1:])
    assert m["context_parallel"] == {
        "cp": 2,
        "rotate_method": "alltoall",
        "seq_per_rank": 128,
        "attention_layers": 2,
        "kv_buffer_bytes": 2 * 128 * 2048 * 2,  # two chunks of 128 tokens, K + V 2 x 1024 wide, bf16
        "grad_kv_buffer_bytes": 2 * 128 * 2048 * 4,
    }
    assert any("modelled, not traced" in note and "alltoall" in note for note in m["estimated"])


def test_without_cp_nothing_is_modelled(capsys: pytest.CaptureFixture[str]) -> None:
    m = plan_json(capsys, *LLAMA, "--mesh", "dp=2", "--seq", "128")
    assert m["context_parallel"] is None
    assert not any("context parallelism" in note for note in m["estimated"])
