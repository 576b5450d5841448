"""Planning, applying and the imperative API against torch's own walk of the
same model (prints figures; not a test).

The model is ``plan_scaling.py``'s synthetic decoder on the meta device.
The baseline is what merely reading the model costs torch:
``list(named_modules())`` plus ``list(named_parameters())``. Each run
measures, interleaved on the same model, the median of ``--repeats`` calls
of:

- ``walk``: that baseline;
- ``plan``: ``fsdptx.plan`` with the default pipeline and a bf16 policy;
- ``plan + apply``: ``plan`` then ``apply_plan`` with a primitive that
  records nothing. Called apart, ``apply_plan`` walks the model again to
  refuse a stale plan;
- ``one walk``: what ``FSDP2Manager.parallelize`` does: one index of the
  model, planned from and then applied with (the same primitive), so the
  model is walked once;
- ``imperative``: ``fully_shard_by_dtype`` on every block (the fp32
  holders ignored), then the root, with ``mark_sharded`` (on fresh models).

Every ratio is taken within one run, against its baseline measured in that
run; the table shows the median of ``--runs`` runs' ratios with their
range (min-max). Targets (issue 20):

- ``plan / walk`` <= 2.0x at every size, and its growth from the smallest
  to the largest size (``plan / walk`` at the largest over the smallest,
  per run) <= 1.1x;
- ``plan + apply / plan`` <= 1.2x, taken on the one-walk path (the
  issue's "one walk"); the two-walk figure is printed beside it;
- ``imperative / plan`` <= 1.0x.

``--no-caches`` measures everything under ``fsdptx.caches(enabled=False)``:
the plain functions, without block replay, vouching or memos.

Usage: PYTHONPATH=. python benchmarks/house_speed.py [--blocks 32 256 2048] [--runs 3] [--repeats 3] [--no-caches]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
from collections.abc import Callable

import torch
from torch import nn

import fsdptx
from fsdptx.apply._apply import apply_indexed
from fsdptx.model._index import ModelIndex
from fsdptx.plan._compose import plan_indexed
from _timing import seconds  # benchmarks/ is on sys.path when run as a script
from plan_scaling import PIPELINE, POLICY, build, imperative, median_seconds, record


def torch_walk(model: nn.Module) -> None:
    """What torch pays to read the model: every module and every parameter."""
    list(model.named_modules())
    list(model.named_parameters())


def one_walk(model: nn.Module) -> None:
    """Plan and apply reading one index of the model, as ``parallelize`` does."""
    index = ModelIndex.build(model)
    planned = plan_indexed(model, PIPELINE, index, mp_policy=POLICY)
    apply_indexed(planned, model, None, index, shard_module=record)  # type: ignore[arg-type]


def one_run(blocks: int, repeats: int) -> dict[str, float]:
    """Seconds of each measurement at one size, the median of ``repeats``
    calls each, measured in one run on one model."""
    model = build(blocks)
    timed: dict[str, Callable[[], object]] = {
        "walk": lambda: torch_walk(model),
        "plan": lambda: fsdptx.plan(model, PIPELINE, mp_policy=POLICY),
        "both": lambda: fsdptx.apply_plan(
            fsdptx.plan(model, PIPELINE, mp_policy=POLICY), model, None, shard_module=record  # type: ignore[arg-type]
        ),
        "one walk": lambda: one_walk(model),
    }
    out = {name: median_seconds(fn, repeats) for name, fn in timed.items()}
    fresh = [build(blocks) for _ in range(repeats + 1)]  # the imperative API marks its model sharded
    imperative(fresh.pop())
    out["imperative"] = statistics.median(seconds(lambda: imperative(m)) for m in fresh)
    del fresh, model
    gc.collect()
    return out


def spread(values: list[float]) -> str:
    """Median and range of per-run ratios."""
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median and range)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per measurement in a run (their median)")
    parser.add_argument("--no-caches", action="store_true", help="measure with fsdptx.caches(enabled=False)")
    args = parser.parse_args()

    switch = fsdptx.caches(enabled=False) if args.no_caches else contextlib.nullcontext()
    runs: dict[int, list[dict[str, float]]] = {}
    with switch:
        for _ in range(args.runs):  # sizes inside runs: run r of every size is measured close in time
            for blocks in args.blocks:
                runs.setdefault(blocks, []).append(one_run(blocks, args.repeats))

    caches = "off" if args.no_caches else "on"
    print(f"torch {torch.__version__}; caches {caches}; ratios: median of {args.runs} runs (min-max)\n")
    print(
        "| blocks | modules | walk us/module | plan us/module | plan / walk | "
        "plan+apply / plan, one walk | plan+apply / plan, two walks | imperative / plan |"
    )
    print("|---:" * 8 + "|")
    for blocks, measured in runs.items():
        modules = sum(1 for _ in build(blocks).modules())
        walk = statistics.median(m["walk"] for m in measured) / modules * 1e6
        plan = statistics.median(m["plan"] for m in measured) / modules * 1e6
        print(
            f"| {blocks} | {modules:,} | {walk:.2f} | {plan:.2f} | "
            f"{spread([m['plan'] / m['walk'] for m in measured])} | "
            f"{spread([m['one walk'] / m['plan'] for m in measured])} | "
            f"{spread([m['both'] / m['plan'] for m in measured])} | "
            f"{spread([m['imperative'] / m['plan'] for m in measured])} |"
        )
    first, last = args.blocks[0], args.blocks[-1]
    growth = [
        (b["plan"] / b["walk"]) / (a["plan"] / a["walk"]) for a, b in zip(runs[first], runs[last])
    ]
    print(f"\nplan / walk growth from {first} to {last} blocks: {spread(growth)}")
    print(
        "\ntargets: plan / walk <= 2.0x at every size, its growth <= 1.1x; "
        "plan+apply / plan (one walk) <= 1.2x; imperative / plan <= 1.0x"
    )


if __name__ == "__main__":
    main()
