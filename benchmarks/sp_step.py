"""Benchmark: one sequence-parallel training step, fsdptx vs torchtitan's pattern.

Run::

    PYTHONPATH=.:tests/support python benchmarks/sp_step.py [--rounds 3] [--steps 10] [--models titan decoder mixtral qwen3_moe]

4 gloo ranks on CPU, a (dp=2, tp=2) mesh, sequence parallelism, fp32. Two
Llama-shaped models at torchtitan's debug size (dim 256, 4 layers, seq 64,
batch 2 per data-parallel rank):

- ``titan``: laid out like torchtitan's Llama 3 (blocks in a ModuleDict),
  given to fsdptx as the explicit plan torchtitan writes (``tp_plan=``);
- ``decoder``: fsdptx's ``llama``-shaped preset with its Hugging Face style
  plan, the sequence-parallel layout derived by fsdptx;
- ``mixtral``, ``qwen3_moe``: Hugging Face MoE models built from their
  configs at the same width (8 experts of width 256, top-2, 4 layers) with
  their declared plans; the baseline is torchtitan's MoE pattern by hand
  (the MoE block gathers its input and reduce-scatters the experts'
  ``Partial`` sum, experts split inside, Qwen3's q/k norms
  ``SequenceParallel(sequence_dim=2)``).

Each is trained by ``FSDP2Manager`` and, as the baseline, parallelized by
hand in torchtitan's pattern (``tests/support/titan_pattern.py``: ``parallelize_module``
with torchtitan's styles, ``fully_shard`` per block and root). Per round and
method one fresh spawn of 4 processes (so peak RSS is the method's own):
warm-up steps, then ``--steps`` timed steps (forward, backward, TP-replica
sync for fsdptx, SGD), the median of the slowest rank's step time. TP
collectives of one step are recorded on rank 0 (count and bytes, by op).
Ratios are fsdptx over the baseline of the same round; the spread is over
``--rounds`` rounds. It prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.core._sizes import format_bytes
from fsdptx.hf import build_hf_model
from fsdptx.presets import Decoder, DecoderConfig, Titan, TitanConfig
from fsdptx.testing import record_collectives, run_distributed

from titan_pattern import explicit_plan, parallelize_by_hand  # tests/support on PYTHONPATH

BATCH, SEQ, VOCAB = 2, 64, 2048
TP_GROUPS = ((0, 1), (2, 3))
MODELS = ("titan", "decoder", "mixtral", "qwen3_moe")
# titan_pattern's layout for each Hugging Face model
BY_HAND = {"mixtral": "hf_mixtral", "qwen3_moe": "hf_qwen3_moe"}
_HF = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=16,
    max_position_embeddings=SEQ,
    num_experts_per_tok=2,
)
_HF_OVERRIDES: dict[str, dict[str, Any]] = {
    "mixtral": {**_HF, "intermediate_size": 256, "num_local_experts": 8},
    "qwen3_moe": {**_HF, "moe_intermediate_size": 256, "num_experts": 8},
}


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "titan":
        return Titan(TitanConfig(vocab=VOCAB, dim=256, n_heads=16, n_kv_heads=8, hidden=768, layers=4, max_seq_len=SEQ))
    if model in _HF_OVERRIDES:
        built: nn.Module = build_hf_model(model, _HF_OVERRIDES[model], dtype=torch.float32, device="cpu")
        return built
    return Decoder(DecoderConfig(vocab=VOCAB, dim=256, hidden=768, layers=4))


def _worker(rank: int, world_size: int, model_name: str, method: str, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build(model_name)
    if method == "torchtitan":
        parallelize_by_hand(model, BY_HAND.get(model_name, model_name), mesh)
    else:
        plan = explicit_plan("titan") if model_name == "titan" else None
        config = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, tp_plan=plan)
        fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(mesh.get_coordinate()[0])
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def step() -> None:
        opt.zero_grad()
        out = model(tokens[:, :-1])
        logits = getattr(out, "logits", out)  # Hugging Face models return an output object
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        if method == "fsdptx":  # the step fsdptx documents; "fsdptx_no_sync" isolates the parallelization
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()

    for _ in range(2):
        step()
    with record_collectives() as calls:
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    tp = [c for c in calls if c.group in TP_GROUPS]
    nbytes = lambda c: max(torch.Size(s).numel() * d.itemsize for s, d in zip(c.shapes, c.dtypes))  # noqa: E731
    return {
        "step_s": statistics.median(times),
        "tp_count": Counter(c.op for c in tp),
        "tp_bytes": Counter({op: sum(nbytes(c) for c in tp if c.op == op) for op in {c.op for c in tp}}),
        "all_reduce_max": max((nbytes(c) for c in tp if "all_reduce" in c.op or "allreduce" in c.op), default=0),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f}x (min {min(values):.3f}, max {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    for model_name in args.models:
        ratios: list[float] = []
        bare: list[float] = []
        rss: list[float] = []
        last: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            for method in ("torchtitan", "fsdptx", "fsdptx_no_sync"):
                ranks = run_distributed(_worker, 4, model_name, method, args.steps, timeout_s=900, collective_timeout_s=120)
                last[method] = ranks[0] | {"peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}
            ratios.append(last["fsdptx"]["step_s"] / last["torchtitan"]["step_s"])
            bare.append(last["fsdptx_no_sync"]["step_s"] / last["torchtitan"]["step_s"])
            rss.append(last["fsdptx"]["peak_rss_mib"] / last["torchtitan"]["peak_rss_mib"])
        ours, base = last["fsdptx"], last["torchtitan"]
        print(f"== {model_name}: fsdptx vs torchtitan's pattern, dp=2 x tp=2 + SP, {args.rounds} rounds")
        print(f"  step time: fsdptx {ours['step_s'] * 1e3:.1f} ms, torchtitan {base['step_s'] * 1e3:.1f} ms (last round); ratio {_spread(ratios)}")
        print(f"  step time without the TP-replica sync call: ratio {_spread(bare)}")
        for op in sorted(set(ours["tp_count"]) | set(base["tp_count"])):
            print(
                f"  TP {op}: {ours['tp_count'][op]} vs {base['tp_count'][op]} per step, "
                f"{format_bytes(ours['tp_bytes'][op])} vs {format_bytes(base['tp_bytes'][op])}"
            )
        print(f"  largest TP all-reduce: {ours['all_reduce_max']} B vs {base['all_reduce_max']} B")
        print(f"  peak RSS per rank: fsdptx {ours['peak_rss_mib']:.0f} MiB, torchtitan {base['peak_rss_mib']:.0f} MiB; ratio {_spread(rss)}")


if __name__ == "__main__":
    main()
