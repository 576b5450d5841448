"""Benchmark: one pipeline-parallel training step, fsdptx vs torchtitan's pattern.

Run::

    PYTHONPATH=.:tests/support python benchmarks/pp_step.py [--rounds 3] [--steps 5] [--schedules 1F1B Interleaved1F1B]

4 gloo ranks on CPU, a (pp=2, dp=2) mesh, fp32, the ``Titan`` preset (laid
out like torchtitan's Llama 3) at torchtitan's debug size: dim 256, 4
layers, sequence 64, vocabulary 2048, batch 8 per data-parallel rank in 4
micro-batches. Two schedules: ``1F1B`` (one stage per rank) and
``Interleaved1F1B`` (two per rank, four stages of one block each).

- fsdptx: ``FSDP2Manager(FSDP2Config(pipeline_parallel=...), mesh).parallelize(model, loss_fn=...)``
  and ``stages.step(...)``.
- the baseline, torchtitan 0.2.2's ``pipeline_llm`` written out by hand
  (``tests/support/titan_pipeline.py``):
  per stage a deep copy of the model with the other stages' modules removed
  (blocks deleted from ``layers``, the embedding, norm and head replaced by
  ``nn.Identity`` since the preset's ``forward`` calls them, where
  torchtitan's sets them to ``None`` and tests for it), a ``PipelineStage``
  per copy, ``fully_shard`` over the dp mesh on the embedding, each block,
  norm + head together and the stage root, never resharding after forward
  (torchtitan's default under PP), and torch's schedule from
  ``get_schedule_class``. The split is the one fsdptx plans (torchtitan's
  ``module_fqns_per_model_part``), so both run the same stages. The loss is a
  per-micro-batch mean and torch scales the gradients (torchtitan sums over
  tokens and divides by the global token count instead: the same gradient).

Per round and method one fresh spawn of 4 processes (so peak RSS is the
method's own), the method going first alternating from round to round. Both build the model from the same seed and train on the same
tokens; the loss of the first two steps (mean over micro-batches and dp
ranks) shows they agree. After those warm-up steps one step's collectives
are recorded on rank 0 (count and bytes by op; bytes are the largest tensor
argument, the gathered or scattered buffer, as ``sp_step.py`` counts them),
then ``--steps`` timed steps (pipeline step and SGD), of which the median of
the slowest rank's step time is kept. The bubble printed from the Plan is
``(pp - 1) / (v * m + pp - 1)``; the measured idle share is one minus the
time a rank spends inside its stages' forward and backward chunks over the
step time, the mean over ranks. It also counts waiting on p2p transfers, FSDP
collectives outside the chunks and the loss, and on 4 ranks sharing 2 cores
the time a rank is descheduled, so it reads above the formula. Ratios are
fsdptx over the baseline of the same round; the spread is over ``--rounds``
rounds. It prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.core._sizes import format_bytes
from fsdptx.plan._stages import bubble_fraction
from fsdptx.presets import Titan, TitanConfig
from fsdptx.testing import Collective, record_collectives, run_distributed

from titan_pipeline import pipeline_by_hand  # tests/support on PYTHONPATH

BATCH, SEQ, VOCAB, MICROBATCHES, WARMUP = 8, 64, 2048, 4, 2
CONFIG = TitanConfig(vocab=VOCAB, dim=256, n_heads=16, n_kv_heads=8, hidden=768, layers=4, max_seq_len=SEQ)
STAGES_PER_RANK = {"1F1B": 1, "Interleaved1F1B": 2}
# torchtitan's module_fqns_per_model_part, written as the split fsdptx plans
# by default (checked against the Plan in the fsdptx run and printed)
SPLITS = {
    "1F1B": (("tok_embeddings", "layers.0", "layers.1"), ("layers.2", "layers.3", "norm", "output")),
    "Interleaved1F1B": (("tok_embeddings", "layers.0"), ("layers.1",), ("layers.2",), ("layers.3", "norm", "output")),
}


def build() -> Titan:
    torch.manual_seed(0)
    return Titan(CONFIG)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def _timed(fn: Callable[..., Any], busy: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    return run


def _nbytes(c: Collective) -> int:
    return max(torch.Size(s).numel() * d.itemsize for s, d in zip(c.shapes, c.dtypes))


def _worker(rank: int, world_size: int, schedule: str, method: str, steps: int) -> dict[str, Any]:
    del rank, world_size
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    model = build()
    split: tuple[tuple[str, ...], ...] | None = None
    bubble = None
    if method == "fsdptx":
        pipeline = fsdptx.PipelineParallelConfig(
            schedule=schedule, microbatches=MICROBATCHES, stages_per_rank=STAGES_PER_RANK[schedule]
        )
        config = fsdptx.FSDP2Config(pipeline_parallel=pipeline, mp_policy=None)
        stages = fsdptx.FSDP2Manager(config, mesh).parallelize(model, loss_fn=loss_fn)
        assert isinstance(stages, fsdptx.PipelineStages)
        p = stages.pipeline
        split = tuple(tuple(s.modules) for s in p.stages)
        bubble = bubble_fraction(p.size, p.microbatches, p.stages_per_rank)
        modules, torch_stages = list(stages), stages.stages
        is_first, is_last = stages.is_first, stages.is_last
        run: Callable[[torch.Tensor | None, torch.Tensor | None], list[torch.Tensor] | None] = stages.step
    else:
        modules, torch_stages, sched = pipeline_by_hand(model, mesh, SPLITS[schedule], schedule, MICROBATCHES, loss_fn)
        is_first, is_last = any(s.is_first for s in torch_stages), any(s.is_last for s in torch_stages)

        def run(inputs: torch.Tensor | None, target: torch.Tensor | None) -> list[torch.Tensor] | None:
            losses: list[torch.Tensor] | None = [] if is_last else None
            sched.step(*(() if inputs is None else (inputs,)), target=target, losses=losses, return_outputs=False)
            return losses
    del model
    busy = [0.0]
    for s in torch_stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(s, name, _timed(getattr(s, name), busy))
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.01)
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # one batch per dp rank
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def step() -> list[torch.Tensor] | None:
        opt.zero_grad()
        losses = run(tokens[:, :-1] if is_first else None, tokens[:, 1:] if is_last else None)
        opt.step()
        return losses

    first_losses = []
    for _ in range(WARMUP):
        got = step()
        first_losses.append(torch.stack(got).mean().item() if got is not None else None)
    with record_collectives() as calls:
        step()
    times, idle = [], []
    for _ in range(steps):
        dist.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
        idle.append(1 - busy[0] / elapsed.item())
    return {
        "step_s": statistics.median(times),
        "idle": statistics.median(idle),
        "losses": first_losses,
        "split": split,
        "bubble": bubble,
        "count": Counter(c.op for c in calls),
        "bytes": Counter({op: sum(_nbytes(c) for c in calls if c.op == op) for op in {c.op for c in calls}}),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}x (min {min(values):.3f}, max {max(values):.3f})"


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's figures, the largest RSS, the mean idle share, and the loss
    per warm-up step as the mean over the last stage's (dp) ranks."""
    last = [r["losses"] for r in ranks if r["losses"][0] is not None]
    return ranks[0] | {
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "idle": statistics.mean(r["idle"] for r in ranks),
        "losses": [statistics.mean(step) for step in zip(*last)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedules", nargs="+", choices=list(STAGES_PER_RANK), default=list(STAGES_PER_RANK))
    args = parser.parse_args()
    for schedule in args.schedules:
        ratios: list[float] = []
        rss: list[float] = []
        idle: dict[str, list[float]] = {"fsdptx": [], "torchtitan": []}
        last: dict[str, dict[str, Any]] = {}
        for round_ in range(args.rounds):
            # alternate which method goes first: the load of a shared machine drifts within a round
            for method in ("torchtitan", "fsdptx")[:: 1 if round_ % 2 == 0 else -1]:
                ranks = run_distributed(_worker, 4, schedule, method, args.steps, timeout_s=600, collective_timeout_s=120)
                last[method] = _summary(ranks)
                idle[method].append(last[method]["idle"])
            ratios.append(last["fsdptx"]["step_s"] / last["torchtitan"]["step_s"])
            rss.append(last["fsdptx"]["peak_rss_mib"] / last["torchtitan"]["peak_rss_mib"])
        ours, base = last["fsdptx"], last["torchtitan"]
        stages = len(SPLITS[schedule])
        print(f"== {schedule}: fsdptx vs torchtitan's pattern, pp=2 x dp=2, {stages} stages, {MICROBATCHES} micro-batches, {args.rounds} rounds")
        same = "the same as" if ours["split"] == SPLITS[schedule] else "NOT the same as"
        print(f"  stages (fsdptx's Plan, {same} the baseline's): {' | '.join(' '.join(s) for s in ours['split'])}")
        print(f"  step time: fsdptx {ours['step_s'] * 1e3:.1f} ms, torchtitan {base['step_s'] * 1e3:.1f} ms (last round); ratio {_spread(ratios)}")
        for n, (a, b) in enumerate(zip(ours["losses"], base["losses"]), 1):
            print(f"  loss of step {n}: fsdptx {a:.6f}, torchtitan {b:.6f}, difference {a - b:.2e}")
        print(
            f"  bubble: Plan {ours['bubble']:.1%}; measured idle share (mean of ranks, median of rounds) "
            f"fsdptx {statistics.median(idle['fsdptx']):.1%}, torchtitan {statistics.median(idle['torchtitan']):.1%}"
        )
        for op in sorted(set(ours["count"]) | set(base["count"])):
            print(
                f"  rank 0 {op}: {ours['count'][op]} vs {base['count'][op]} per step, "
                f"{format_bytes(ours['bytes'][op])} vs {format_bytes(base['bytes'][op])}"
            )
        print(f"  peak RSS per rank: fsdptx {ours['peak_rss_mib']:.0f} MiB, torchtitan {base['peak_rss_mib']:.0f} MiB; ratio {_spread(rss)}")


if __name__ == "__main__":
    main()
