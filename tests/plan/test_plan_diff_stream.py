"""The residual stream in a plan diff reads like the rest of the diff: one
line per module and field that changed, block indices collapsed, never the
whole stream printed twice on one line. ``str(plan)`` says in which order
its stream table lists the modules."""

from __future__ import annotations

import functools
from typing import Any

import torch

import fsdptx
from fsdptx.plan._plan import Plan
from fsdptx.plan._types import StreamStep, TensorParallel
from fsdptx.presets import Decoder, DecoderConfig, titan
from fsdptx.testing import fake_mesh

CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=4)


def manager_plan(**config: Any) -> Plan:
    with torch.device("meta"):
        model = Decoder(CFG)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        return fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, **config), mesh).plan(model)


def test_leaving_the_mlps_out_of_the_tp_plan_is_a_few_lines_one_per_change() -> None:
    with torch.device("meta"):
        declared = dict(Decoder(CFG)._tp_plan)
    without_mlp = {k: v for k, v in declared.items() if ".mlp." not in k}
    d = fsdptx.diff_plans(manager_plan(), manager_plan(tp_plan=without_mlp))
    assert str(d).splitlines() == [
        "layers.{0..3}.mlp: gather_sequence (sp) -> whole_sequence (sp)",
        "layers.{0..3}.mlp.down_proj: rowwise -> (none)",
        "layers.{0..3}.mlp.gate_proj: colwise -> (none)",
        "layers.{0..3}.mlp.up_proj: colwise -> (none)",
        "layers.{0..3}.mlp: stream added all-gather in as a Replicate DTensor -> gather in, slice out: no TP style inside",
    ]


def step(module: str, role: str = "region", takes: str = "Shard(1)", gives: str = "Shard(1)", added: str | None = None) -> StreamStep:
    return StreamStep(module, role, takes, gives, added)


def with_stream(*steps: StreamStep) -> Plan:
    return Plan(tensor_parallel=TensorParallel((), True, stream=steps))


def test_a_step_that_changes_is_one_line_per_field_and_collapses_over_blocks() -> None:
    before = with_stream(*(step(f"layers.{i}.mlp") for i in range(8)))
    after = with_stream(*(step(f"layers.{i}.mlp", takes="whole", added="gathered") for i in range(8)))
    assert str(fsdptx.diff_plans(before, after)).splitlines() == [
        "layers.{0..7}.mlp: stream takes Shard(1) -> whole",
        "layers.{0..7}.mlp: stream added (none) -> gathered",
    ]


def test_steps_gained_lost_and_reordered_are_named() -> None:
    a, b, c = step("embed", "embedding", "token ids"), step("layers.0", "block"), step("norm", "norm")
    gained = fsdptx.diff_plans(with_stream(a, b), with_stream(a, b, c))
    assert str(gained) == "norm: stream gains norm: Shard(1) -> Shard(1)"
    lost = fsdptx.diff_plans(with_stream(a, b, c), with_stream(a, c))
    assert str(lost) == "layers.0: stream loses block: Shard(1) -> Shard(1)"
    moved = fsdptx.diff_plans(with_stream(a, b, c), with_stream(a, c, b))
    assert str(moved) == "stream order changes: now embed, norm, layers.0"


def test_no_line_of_a_diff_repeats_the_stream() -> None:
    p, q = manager_plan(), manager_plan(loss_parallel=True, tp_plan={"lm_head": "colwise"})
    lines = str(fsdptx.diff_plans(p, q)).splitlines()
    assert lines and all("StreamStep(" not in line and len(line) < 200 for line in lines), lines


def test_str_plan_says_a_blocks_children_are_listed_in_registration_order() -> None:
    """torchtitan registers a block's attention and feed-forward before the
    norms its forward calls first (the Titan preset does the same); the
    stream table lists them as registered, and its heading says so."""
    with torch.device("meta"):
        model = titan(2)
    plan = {
        "tok_embeddings": "embedding_rowwise",
        "layers.*.attention.w[qkv]": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w[13]": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise_rep",
    }
    p = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, plan=plan, sequence_parallel=True))
    assert p.tensor_parallel is not None
    order = [s.module for s in p.tensor_parallel.stream if s.module.startswith("layers.0.")]
    assert order == ["layers.0.attention", "layers.0.feed_forward", "layers.0.attention_norm", "layers.0.ffn_norm"]
    heading = next(line for line in str(p).splitlines() if line.lstrip().startswith("stream"))
    assert heading.strip().startswith("stream (blocks in forward order, a block's children in registration order)")
