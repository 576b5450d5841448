"""The memory plan against torch's FSDPMemTracker, at sizes too big for a test,
and what the dry run costs.

1. Cross-check: ``fsdptx.estimate_memory`` vs the plain tracker recipe
   (parallelize the meta model, materialize it in ``FakeTensorMode``, two
   iterations under ``FSDPMemTracker``, AdamW state from the first) on the
   llama preset for dp=8 AC off / full and dp=2 x tp=2 + SP; each stage of
   pp=2 x dp=2 (1F1B, 4 micro-batches) against the stage recipe
   (``tests/support/stage_tracker_recipe.py``); each pp rank of the same
   mesh under Interleaved1F1B (2 stages per rank) against torch's
   MemTracker over the rank's stages (``tests/support/rank_tracker_recipe.py``,
   peak only); and a Qwen3-MoE with its
   experts split across ep=2 and ep=4 (dense dp_shard=4) against the EP recipe with the routing forced balanced and transformers'
   own dispatch (``tests/support/ep_tracker_recipe.py``). Targets: params,
   grads, optimizer within 1%; activations within 15%; peak -10%/+15%.
2. ``--fit`` extrapolation: the predicted peak of a few candidates against a
   full re-plan of the same configuration.
3. Wall time of the 80-layer HF Llama dry run with activations
   (``--batch 1 --seq 4096``, dp=8; target under 60 s) and of ``--fit``
   over every mesh of 64 GPUs (target under 5 minutes).

Run: ``PYTHONPATH=.:tests/support python benchmarks/memory_check.py [--layers 16] [--seq 2048] [--skip-timing] [--cross-check-only]``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.cli._main import main
from fsdptx.core._sizes import format_bytes
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

from _timing import seconds  # benchmarks/ is on sys.path when run as a script
from ep_tracker_recipe import build_moe, ep_tracker_reference  # tests/support on PYTHONPATH
from rank_tracker_recipe import rank_tracker_peak
from stage_tracker_recipe import stage_tracker_reference
from tracker_recipe import tracker_reference

LLAMA_70B = (
    "num_hidden_layers=80,hidden_size=8192,intermediate_size=28672,num_attention_heads=64,"
    "num_key_value_heads=8,vocab_size=128256"
)


def reference(layers: int, seq: int, shape: Sequence[int], names: Sequence[str], config: fsdptx.FSDP2Config) -> dict[str, int]:
    """The plain FSDPMemTracker recipe on the llama preset (``tests/support/tracker_recipe.py``)."""
    return dataclasses.asdict(tracker_reference(layers, seq, shape, names, config))


def planned(layers: int, seq: int, shape: Sequence[int], names: Sequence[str], config: fsdptx.FSDP2Config) -> dict[str, int]:
    with torch.device("meta"):
        model = build_preset("llama", layers)
    with fake_mesh(shape, names) as mesh:
        e = fsdptx.estimate_memory(fsdptx.FSDP2Manager(config, mesh), model, batch=1, seq=seq)
    return {
        "params": e.params_bytes,
        "grads": e.grads_bytes,
        "optimizer": e.optimizer_bytes,
        "activations": e.activations_bytes,
        "peak": e.peak_bytes,
    }


TARGETS = {"params": (-0.01, 0.01), "grads": (-0.01, 0.01), "optimizer": (-0.01, 0.01), "activations": (-0.15, 0.15), "peak": (-0.10, 0.15)}


def rows(label: str, ours: dict[str, int], ref: dict[str, int]) -> list[str]:
    """One table row per figure of ``TARGETS``."""
    out = []
    for key, (low, high) in TARGETS.items():
        err = ours[key] / ref[key] - 1 if ref[key] else 0.0
        ok = "ok" if low <= err <= high else "MISSED"
        out.append(
            f"| {label} | {key} | {ours[key]:,} | {ref[key]:,} | {100 * err:+.2f}% | "
            f"{100 * low:+.0f}%/{100 * high:+.0f}% {ok} |"
        )
    print("\n".join(out), flush=True)
    return out


TABLE = ["| config | figure | fsdptx | FSDPMemTracker | error | target |", "|---|---|---:|---:|---:|---|"]


def cross_check(layers: int, seq: int) -> list[str]:
    cases = {
        "dp=8, AC off": ((8,), ("dp",), fsdptx.FSDP2Config()),
        "dp=8, AC full": ((8,), ("dp",), fsdptx.FSDP2Config(activation_checkpointing="full")),
        "dp=2 x tp=2 + SP": ((2, 2), ("dp", "tp"), fsdptx.FSDP2Config(sequence_parallel=True)),
    }
    lines = [f"### Cross-check: llama preset, {layers} layers, batch 1 x seq {seq}", "", *TABLE]
    for label, (shape, names, config) in cases.items():
        ours, ref = planned(layers, seq, shape, names, config), reference(layers, seq, shape, names, config)
        lines += rows(label, ours, ref)
    return lines


PP_ORDERS = ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3")  # 1F1B, 2 stages, 4 micro-batches, as torch runs them


def pipeline_cross_check(layers: int, seq: int) -> list[str]:
    """Each stage of pp=2 x dp=2 (1F1B, 4 micro-batches of one sequence):
    the dry run's traced stage step against the stage recipe."""
    data = run_json(
        "--preset", "llama", "--layers", str(layers), "--mesh", "pp=2,dp=2", "--schedule", "1F1B",
        "--microbatches", "4", "--batch", "4", "--seq", str(seq),
    )
    stages = data["stages"]
    assert isinstance(stages, list)
    config = fsdptx.FSDP2Config(pipeline_parallel=fsdptx.PipelineParallelConfig(schedule="1F1B", microbatches=4))
    lines = [
        f"### Cross-check: pipeline stages, llama preset, {layers} layers, pp=2 x dp=2, 1F1B, 4 micro-batches "
        f"of 1 x seq {seq}",
        "",
        *TABLE,
    ]
    with torch.device("meta"):
        embedding = build_preset("llama", 1).get_submodule("embed_tokens")
    assert isinstance(embedding, nn.Embedding)
    dim = embedding.embedding_dim
    for stage in stages:
        r = stage["index"]
        ref = stage_tracker_reference(
            layers, seq, (2, 2), ("pp", "dp"), config, pp_rank=r, order=PP_ORDERS[r], hidden=(1, seq, dim)
        )
        m = stage["memory"]
        ours = {k: m[f"{k}_bytes"] for k in TARGETS}
        lines += rows(f"pp=2 x dp=2, stage {r}", ours, dataclasses.asdict(ref))
    return lines


def interleaved_cross_check(layers: int, seq: int) -> list[str]:
    """Each pp rank of pp=2 x dp=2 under Interleaved1F1B (2 stages per rank,
    4 micro-batches of one sequence): the dry run's traced rank against
    torch's MemTracker over the same rank's stages in torch's own order
    (``tests/support/rank_tracker_recipe.py``, which gives the peak only)."""
    pipe = fsdptx.PipelineParallelConfig(schedule="Interleaved1F1B", microbatches=4, stages_per_rank=2)
    data = run_json(
        "--preset", "llama", "--layers", str(layers), "--mesh", "pp=2,dp=2", "--schedule", "Interleaved1F1B",
        "--stages-per-rank", "2", "--microbatches", "4", "--batch", "4", "--seq", str(seq),
    )
    ranks = data["ranks"]
    assert isinstance(ranks, list)
    with torch.device("meta"):
        embedding = build_preset("llama", 1).get_submodule("embed_tokens")
    assert isinstance(embedding, nn.Embedding)
    lines = [
        f"### Cross-check: interleaved pipeline ranks, llama preset, {layers} layers, pp=2 x dp=2, Interleaved1F1B, "
        f"2 stages per rank, 4 micro-batches of 1 x seq {seq} (reference: torch's MemTracker over the rank's stages)",
        "",
        *TABLE,
    ]
    low, high = TARGETS["peak"]
    config = fsdptx.FSDP2Config(pipeline_parallel=pipe)
    for rank in ranks:
        r = rank["rank"]
        ref = rank_tracker_peak(layers, seq, (2, 2), ("pp", "dp"), config, pp_rank=r, hidden=(1, seq, embedding.embedding_dim))
        ours = rank["memory"]["peak_bytes"]
        err = ours / ref - 1
        line = (
            f"| pp=2 x dp=2 interleaved, rank {r} (stages {', '.join(map(str, rank['stages']))}) | peak | {ours:,} | "
            f"{ref:,} | {100 * err:+.2f}% | {100 * low:+.0f}%/{100 * high:+.0f}% {'ok' if low <= err <= high else 'MISSED'} |"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


MOE = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "num_experts": 16,
    "num_experts_per_tok": 2,
}


def ep_cross_check(seq: int) -> list[str]:
    """A Qwen3-MoE (``MOE``, fp32 master weights, bf16 compute) with its
    experts split across ``ep``: ``estimate_memory`` (balanced routing)
    against the EP recipe with the routing forced balanced."""
    cases = {
        "dp_shard=4, experts ep_shard=2 x ep=2": ((4,), ("dp_shard",), (2, 2), ("ep_shard", "ep")),
        "dp_shard=4, experts ep_shard=1 x ep=4": ((4,), ("dp_shard",), (1, 4), ("ep_shard", "ep")),
    }
    described = (
        f"{MOE['num_hidden_layers']} layers, hidden {MOE['hidden_size']}, {MOE['num_experts']} experts of width "
        f"{MOE['moe_intermediate_size']}, top-{MOE['num_experts_per_tok']}, vocab {MOE['vocab_size']}"
    )
    lines = [f"### Cross-check: expert parallelism, Qwen3-MoE ({described}), batch 1 x seq {seq}, balanced routing", "", *TABLE]
    config = fsdptx.FSDP2Config()
    for label, (shape, names, moe_shape, moe_names) in cases.items():
        with fake_mesh(shape, names) as mesh:
            moe = init_device_mesh("cpu", moe_shape, mesh_dim_names=moe_names)
            with torch.device("meta"):
                model = build_moe(config=MOE)
            e = fsdptx.estimate_memory(fsdptx.FSDP2Manager(config, mesh, moe), model, batch=1, seq=seq)
        ours = {
            "params": e.params_bytes,
            "grads": e.grads_bytes,
            "optimizer": e.optimizer_bytes,
            "activations": e.activations_bytes,
            "peak": e.peak_bytes,
        }
        ref = ep_tracker_reference(1, seq, shape, names, moe_shape, moe_names, config, model_config=MOE)
        lines += rows(label, ours, dataclasses.asdict(ref))
    return lines


def run_json(*argv: str) -> dict[str, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *argv, "--json"])
    if code != 0:
        raise SystemExit(f"plan {' '.join(argv)} failed")
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def fit_extrapolation(layers: int, seq: int) -> list[str]:
    model = ("--preset", "llama", "--layers", str(layers), "--seq", str(seq))
    fit = run_json(*model, "--fit", "8x1000GiB")["fit"]
    assert isinstance(fit, dict)
    lines = [
        f"### --fit extrapolation: llama preset, {layers} layers (traced at 2 and 3), seq {seq}, 8 GPUs",
        "",
        "| configuration | predicted peak | re-planned peak | error |",
        "|---|---:|---:|---:|",
    ]
    picks = fit["fitting"][:: max(1, len(fit["fitting"]) // 6)]
    for c in picks:
        replanned = run_json(*model, *c["argv"])["memory"]
        assert isinstance(replanned, dict)
        err = c["peak_bytes"] / replanned["peak_bytes"] - 1
        lines.append(f"| {' '.join(c['argv'])} | {c['peak_bytes']:,} | {replanned['peak_bytes']:,} | {100 * err:+.2f}% |")
        print(lines[-1], flush=True)
    return lines


def timing() -> list[str]:
    hf = ("--hf", "llama", "--hf-config", LLAMA_70B, "--batch", "1", "--seq", "4096")
    out: dict[str, object] = {}
    dry = seconds(lambda: out.update(run_json(*hf, "--mesh", "dp=8")))
    memory = out["memory"]
    assert isinstance(memory, dict)
    fit: dict[str, object] = {}
    search = seconds(lambda: fit.update(run_json(*hf, "--fit", "64x80GiB")))
    result = fit["fit"]
    assert isinstance(result, dict)
    best = result["fitting"][0] if result["fitting"] else None
    lines = [
        "### Wall time (this machine: 2 shared CPU cores)",
        "",
        "| run | seconds | target | result |",
        "|---|---:|---:|---|",
        f"| 80-layer HF Llama (70B shapes) dry run, dp=8, batch 1 x seq 4096 | {dry:.1f} | 60 | "
        f"peak {format_bytes(memory['peak_bytes'])} ({memory['peak_at']}), activations "
        f"{format_bytes(memory['activations_bytes'])} |",
        f"| --fit 64x80GiB, same model ({result['evaluated']} configurations) | {search:.1f} | 300 | "
        f"{len(result['fitting'])} fit; best: {' '.join(best['argv']) if best else '-'} |",
    ]
    print("\n".join(lines[-2:]), flush=True)
    return lines


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--cross-check-only", action="store_true", help="only the cross-checks against the tracker")
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    report = cross_check(args.layers, args.seq)
    report += [""] + pipeline_cross_check(args.layers, args.seq) + [""] + interleaved_cross_check(args.layers, args.seq)
    report += [""] + ep_cross_check(args.seq)
    if not args.cross_check_only:
        report += [""] + fit_extrapolation(args.layers, args.seq)
    if not (args.skip_timing or args.cross_check_only):
        report += [""] + timing()
    print("\n" + "\n".join(report))
