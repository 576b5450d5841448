"""The memory plan against torch's FSDPMemTracker, at sizes too big for a test,
and what the dry run costs.

1. Cross-check: ``fsdptx.estimate_memory`` vs the plain tracker recipe
   (parallelize the meta model, materialize it in ``FakeTensorMode``, two
   iterations under ``FSDPMemTracker``, AdamW state from the first) on the
   llama preset for dp=8 AC off / full and dp=2 x tp=2 + SP. Targets: params,
   grads, optimizer within 1%; activations within 15%; peak -10%/+15%.
2. ``--fit`` extrapolation: the predicted peak of a few candidates against a
   full re-plan of the same configuration.
3. Wall time of the 80-layer HF Llama dry run with activations
   (``--batch 1 --seq 4096``, dp=8; target under 60 s) and of ``--fit``
   over every mesh of 64 GPUs (target under 5 minutes).

Run: ``PYTHONPATH=.:tests/support python benchmarks/memory_check.py [--layers 16] [--seq 2048] [--skip-timing]``
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

import fsdptx
from fsdptx.cli._main import main
from fsdptx.core._sizes import format_bytes
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

from _timing import seconds  # benchmarks/ is on sys.path when run as a script
from tracker_recipe import tracker_reference  # tests/support on PYTHONPATH

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


def cross_check(layers: int, seq: int) -> list[str]:
    cases = {
        "dp=8, AC off": ((8,), ("dp",), fsdptx.FSDP2Config()),
        "dp=8, AC full": ((8,), ("dp",), fsdptx.FSDP2Config(activation_checkpointing="full")),
        "dp=2 x tp=2 + SP": ((2, 2), ("dp", "tp"), fsdptx.FSDP2Config(sequence_parallel=True)),
    }
    lines = [
        f"### Cross-check: llama preset, {layers} layers, batch 1 x seq {seq}",
        "",
        "| config | figure | fsdptx | FSDPMemTracker | error | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    for label, (shape, names, config) in cases.items():
        ours, ref = planned(layers, seq, shape, names, config), reference(layers, seq, shape, names, config)
        for key, (low, high) in TARGETS.items():
            err = ours[key] / ref[key] - 1 if ref[key] else 0.0
            ok = "ok" if low <= err <= high else "MISSED"
            lines.append(
                f"| {label} | {key} | {ours[key]:,} | {ref[key]:,} | {100 * err:+.2f}% | "
                f"{100 * low:+.0f}%/{100 * high:+.0f}% {ok} |"
            )
        print(lines[-1], flush=True)
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
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    report = cross_check(args.layers, args.seq) + [""] + fit_extrapolation(args.layers, args.seq)
    if not args.skip_timing:
        report += [""] + timing()
    print("\n" + "\n".join(report))
