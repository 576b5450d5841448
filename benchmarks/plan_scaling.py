"""How planning and applying scale with model size (prints figures; not a test).

A synthetic decoder on the meta device (per block: 4 attention and 3 MLP
linears, 2 norms, an fp32 holder declared for cross-block grouping, a bf16
sibling) at several depths. For each size it prints:

- microseconds per module for ``fsdptx.plan`` with the default pipeline
  (target: <= 5 us at every size, and the 2048-block figure <= 1.3x the
  32-block one: planning must stay linear);
- ``apply_plan`` on a fake mesh against bare ``fully_shard`` calls of the same
  units with the same arguments (target: <= 5% overhead);
- for context, ``named_modules()`` per module: the cost of merely walking the
  model, which itself grows with size once the model outgrows the CPU caches.

Timings run with the garbage collector paused, as ``timeit`` does, so a
collection triggered by earlier allocations does not land in one sample.

Usage: python benchmarks/plan_scaling.py [--blocks 32 256 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdptx
from fsdptx.planning._apply import shard_kwargs
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def build(blocks: int) -> nn.Module:
    with torch.device("meta"):
        return Decoder(
            DecoderConfig(
                vocab=256, dim=64, hidden=128, layers=blocks, fp32_holders=True, sibling_dtype=torch.bfloat16
            )
        )


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``fn()``, after ``warmup`` untimed calls, with the
    garbage collector paused during each call (as ``timeit`` does)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times)


def time_apply(blocks: int, repeats: int) -> tuple[float, float]:
    """Median seconds of apply_plan and of the bare primitive calls it makes.

    Each repetition needs fresh models (sharding mutates them); building and
    planning are outside both timings, and the bare variant resolves modules
    and arguments before its clock starts, so the difference is fsdptx's
    checking and bookkeeping alone. The two variants alternate which runs
    first, so a drift in machine state does not favour either.
    """
    applied, bare = [], []
    with fake_mesh((8,), ("dp",)) as mesh:
        for repeat in range(repeats):
            a_model, b_model = build(blocks), build(blocks)
            a_plan = fsdptx.plan(a_model, PIPELINE, mp_policy=POLICY)
            b_plan = fsdptx.plan(b_model, PIPELINE, mp_policy=POLICY)
            calls = []
            for unit in b_plan.units:
                mods = [b_model.get_submodule(f) for f in unit.modules]
                calls.append((mods[0] if len(mods) == 1 else mods, shard_kwargs(unit, mesh)))

            def run_apply() -> None:
                fsdptx.apply_plan(a_plan, a_model, mesh)

            def run_bare() -> None:
                for target, kwargs in calls:
                    fully_shard(target, **kwargs)

            order = [(run_apply, applied), (run_bare, bare)]
            for fn, out in order if repeat % 2 == 0 else order[::-1]:
                out.append(median_seconds(fn, 1, warmup=0))
    return statistics.median(applied), statistics.median(bare)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--apply-repeats", type=int, default=3)
    args = parser.parse_args()

    # All planning timings first, then the applying ones: sharding thousands
    # of units leaves a larger, more scattered heap behind, which would slow
    # every later walk of a model and blur the per-size comparison.
    planned = []
    for blocks in args.blocks:
        model = build(blocks)
        modules = sum(1 for _ in model.modules())
        plan_s = median_seconds(lambda: fsdptx.plan(model, PIPELINE, mp_policy=POLICY), args.repeats)
        walk_s = median_seconds(lambda: list(model.named_modules()), args.repeats)
        units = len(fsdptx.plan(model, PIPELINE, mp_policy=POLICY).units)
        planned.append((blocks, modules, units, plan_s, walk_s))
    rows = [(*row, *time_apply(row[0], args.apply_repeats)) for row in planned]

    base = rows[0][3] / rows[0][1]
    print(f"torch {torch.__version__}; median of {args.repeats} plan runs, {args.apply_repeats} apply runs\n")
    print(
        "| blocks | modules | units | plan ms | plan us/module | vs smallest | named_modules us/module "
        "| apply_plan ms | bare fully_shard ms | apply overhead |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for blocks, modules, units, plan_s, walk_s, apply_s, bare_s in rows:
        per_module = plan_s / modules
        print(
            f"| {blocks} | {modules:,} | {units:,} | {plan_s * 1e3:.1f} | {per_module * 1e6:.2f} | "
            f"{per_module / base:.2f}x | {walk_s / modules * 1e6:.2f} | {apply_s * 1e3:.0f} | {bare_s * 1e3:.0f} | "
            f"{(apply_s / bare_s - 1) * 100:+.1f}% |"
        )
    print("\ntargets: <= 5 us/module at every size; largest <= 1.3x smallest per module; apply overhead <= 5%")


if __name__ == "__main__":
    main()
