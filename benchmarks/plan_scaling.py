"""How planning and applying scale with model size (prints figures; not a test).

A synthetic decoder on the meta device (per block: 4 attention and 3 MLP
linears, 2 norms, an fp32 holder declared for cross-block grouping, a bf16
sibling) at several depths. Every figure is the median of ``--runs`` runs,
shown with its spread (max - min, relative to the median); every ratio is
against its baseline measured in the same run, on the same model:

- ``plan``: microseconds per module for ``fsdptx.plan`` with the default
  pipeline (target: <= 5 us at every size; the largest size <= 1.15x the
  smallest per module: planning must stay linear);
- ``plan + apply``: ``plan`` then ``apply_plan`` with a recording primitive,
  against ``plan`` alone (target: <= 1.2x; validation reuses what planning
  knew);
- ``imperative``: ``fully_shard_by_dtype`` on every block with one
  ``ParameterSet`` of every block's fp32 holder parameters as
  ``ignored_params`` (what ``fully_shard_across_blocks`` returns), then on
  the root, against ``plan`` (target: <= 1.2x at the largest size). Its
  primitive does what ``fully_shard`` does to the module class and nothing
  else, so later calls see the earlier units;
- ``apply_plan`` with real ``fully_shard`` on a fake mesh against the bare
  loop of the same calls (target: <= 1.05x);
- for context, ``named_modules()`` per module: the cost of merely walking the
  model, which itself grows with size once the model outgrows the CPU caches;
- an 80-layer Hugging Face Llama (70B shapes) on the meta device: ``plan``
  per module (needs ``transformers``).

Timings run with the garbage collector paused, as ``timeit`` does, so a
collection triggered by earlier allocations does not land in one sample.

Usage: python benchmarks/plan_scaling.py [--blocks 32 256 2048] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdptx
from fsdptx.apply._fsdp import shard_kwargs
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh, mark_sharded

from _timing import seconds  # benchmarks/ is on sys.path when run as a script

PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LLAMA_70B = {
    "num_hidden_layers": 80,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}


def build(blocks: int) -> nn.Module:
    with torch.device("meta"):
        return Decoder(
            DecoderConfig(
                vocab=256, dim=64, hidden=128, layers=blocks, fp32_holders=True, sibling_dtype=torch.bfloat16
            )
        )


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median of ``repeats`` timed calls after one untimed warm-up call."""
    fn()
    return statistics.median(seconds(fn) for _ in range(repeats))


class Figure:
    """One measurement over several runs: median and relative spread."""

    def __init__(self, samples: list[float]) -> None:
        self.samples = samples
        self.median = statistics.median(samples)

    def spread(self) -> str:
        return f"±{(max(self.samples) - min(self.samples)) / self.median * 50:.0f}%"

    def ms(self) -> str:
        return f"{self.median * 1e3:.1f} {self.spread()}"


def ratio(a: Figure, b: Figure) -> str:
    """Median of the per-run ratios (each run's pair was measured together)."""
    return f"{statistics.median(x / y for x, y in zip(a.samples, b.samples)):.2f}x"


def record(target: nn.Module | list[nn.Module], **kwargs: object) -> None:
    """A primitive that records nothing and shards nothing."""


def imperative(model: nn.Module) -> None:
    holders = fsdptx.ParameterSet(p for b in model.layers for p in b.sinks.parameters())
    for block in model.layers:
        fsdptx.fully_shard_by_dtype(block, None, POLICY, None, ignored_params=holders, shard_module=mark_sharded)
    fsdptx.fully_shard_by_dtype(model, None, POLICY, None, ignored_params=holders, shard_module=mark_sharded)


def planning_run(blocks: int, repeats: int) -> tuple[float, float, float, float]:
    """One run at one size: seconds of plan, plan + apply (recording),
    imperative, and named_modules, each the median of ``repeats`` calls."""
    model = build(blocks)
    plan_s = median_seconds(lambda: fsdptx.plan(model, PIPELINE, mp_policy=POLICY), repeats)
    both_s = median_seconds(
        lambda: fsdptx.apply_plan(fsdptx.plan(model, PIPELINE, mp_policy=POLICY), model, None, shard_module=record),
        repeats,
    )
    walk_s = median_seconds(lambda: list(model.named_modules()), repeats)
    fresh = [build(blocks) for _ in range(repeats + 1)]  # the imperative API shards (marks) its model
    imperative(fresh.pop())
    imp_s = statistics.median(seconds(lambda: imperative(m)) for m in fresh)
    return plan_s, both_s, imp_s, walk_s


def apply_run(blocks: int, mesh: object, first: bool) -> tuple[float, float]:
    """Seconds of apply_plan and of the bare primitive calls it makes, on
    fresh models. Planning is outside both timings, and the bare variant
    resolves modules and arguments before its clock starts, so the
    difference is fsdptx's checking and bookkeeping alone; ``first`` says
    which variant runs first, alternated so that drift favours neither."""
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

    if first:
        return seconds(run_apply), seconds(run_bare)
    bare = seconds(run_bare)
    return seconds(run_apply), bare


def llama_figure(repeats: int, runs: int) -> tuple[int, Figure] | None:
    try:
        model = fsdptx.hf.build_hf_model("llama", LLAMA_70B, device="meta")
    except ImportError:
        return None
    modules = sum(1 for _ in model.modules())
    return modules, Figure(
        [median_seconds(lambda: fsdptx.plan(model, PIPELINE, mp_policy=POLICY), repeats) for _ in range(runs)]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 256, 2048])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median and spread)")
    parser.add_argument("--repeats", type=int, default=3, help="calls per run (their median is the run's figure)")
    args = parser.parse_args()

    # All planning timings first, then the applying ones: sharding thousands
    # of units leaves a larger, more scattered heap behind, which would slow
    # every later walk of a model and blur the per-size comparison.
    rows = []
    for blocks in args.blocks:
        model = build(blocks)
        modules = sum(1 for _ in model.modules())
        units = len(fsdptx.plan(model, PIPELINE, mp_policy=POLICY).units)
        del model
        runs = [planning_run(blocks, args.repeats) for _ in range(args.runs)]
        rows.append((blocks, modules, units, *(Figure([r[k] for r in runs]) for k in range(4))))
    llama = llama_figure(args.repeats, args.runs)
    applied = []
    with fake_mesh((8,), ("dp",)) as mesh:
        for blocks, *_ in rows:
            runs = [apply_run(blocks, mesh, first=r % 2 == 0) for r in range(args.runs)]
            applied.append((Figure([a for a, _ in runs]), Figure([b for _, b in runs])))

    print(f"torch {torch.__version__}; each figure: median of {args.runs} runs ± half their spread\n")
    print(
        "| blocks | modules | units | plan ms | plan us/module | vs smallest | plan+apply ms | vs plan "
        "| imperative ms | vs plan | named_modules us/module | apply_plan ms | bare fully_shard ms | vs bare |"
    )
    print("|---:" * 14 + "|")
    base = rows[0][3].median / rows[0][1]
    for (blocks, modules, units, plan_f, both_f, imp_f, walk_f), (apply_f, bare_f) in zip(rows, applied):
        per_module = plan_f.median / modules
        print(
            f"| {blocks} | {modules:,} | {units:,} | {plan_f.ms()} | {per_module * 1e6:.2f} | "
            f"{per_module / base:.2f}x | {both_f.ms()} | {ratio(both_f, plan_f)} | {imp_f.ms()} | "
            f"{ratio(imp_f, plan_f)} | {walk_f.median / modules * 1e6:.2f} | {apply_f.ms()} | {bare_f.ms()} | "
            f"{ratio(apply_f, bare_f)} |"
        )
    if llama is not None:
        modules, figure = llama
        print(
            f"\nHugging Face Llama, 80 layers (70B shapes), meta device: {modules:,} modules, plan "
            f"{figure.ms()} ms = {figure.median / modules * 1e6:.2f} us/module"
        )
    print(
        "\ntargets: plan <= 5 us/module at every size, largest <= 1.15x smallest per module; "
        "plan+apply <= 1.2x plan; imperative <= 1.2x plan at the largest size; apply_plan <= 1.05x bare"
    )


if __name__ == "__main__":
    main()
