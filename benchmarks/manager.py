"""What the manager costs, and what its units save.

1. Wall time of ``FSDP2Manager.parallelize`` (plan + apply: TP with SP,
   full activation checkpointing, FSDP units, prefetch chains, marks) on a
   fake (dp=2, tp=2) mesh, against a hand-written torchtitan-style loop
   issuing the same torch calls: one ``parallelize_module`` with the same
   dict of styles, composable ``checkpoint`` per block, ``fully_shard`` per
   unit with the same kwargs, the same prefetch chains. Models are built on
   the meta device (no storage), so the figures are the bookkeeping cost,
   which is what the manager adds. The target is at most 1.10x; it is
   reported, not asserted (timings on a shared machine are noisy).
2. FSDP all-gathers and reduce-scatters per training step (one forward and
   backward) for the manager's units vs one FSDP unit per module with
   direct parameters, recorded on the fake mesh: fewer, larger collectives
   is what block-level units buy.

Run: ``PYTHONPATH=. python benchmarks/manager.py [--blocks 32 256] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from fsdptx import FSDP2Config, FSDP2Manager, Plan
from fsdptx.apply._fsdp import shard_kwargs
from fsdptx.core._meshes import fsdp_mesh, tp_mesh
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh, record_collectives
from fsdptx.tp import tp_styles_by_module

from _timing import seconds  # benchmarks/ is on sys.path when run as a script

MESH = ((2, 2), ("dp", "tp"))
CONFIG = FSDP2Config(sequence_parallel=True, activation_checkpointing="full", mp_policy=None)


def build(blocks: int, device: str = "meta") -> Decoder:
    with torch.device(device):
        return Decoder(DecoderConfig(vocab=256, dim=64, hidden=128, layers=blocks))


def by_hand(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """The torchtitan-style loop: the same torch calls, written out."""
    assert plan.tensor_parallel is not None and plan.checkpointing is not None
    parallelize_module(model, tp_mesh(mesh), tp_styles_by_module(plan.tensor_parallel))
    for fqn in plan.checkpointing.modules:
        checkpoint(model.get_submodule(fqn))
    dp = fsdp_mesh(mesh)
    for unit in plan.units:
        mods = [model.get_submodule(m) for m in unit.modules]
        fully_shard(mods[0] if len(mods) == 1 else mods, **shard_kwargs(unit, dp))
    for chain in plan.prefetch:
        block = model.get_submodule(chain.unit)
        if chain.forward:
            block.set_modules_to_forward_prefetch([model.get_submodule(m) for m in chain.forward])
        if chain.backward:
            block.set_modules_to_backward_prefetch([model.get_submodule(m) for m in chain.backward])


def compare(blocks: int, repeats: int, mesh: DeviceMesh) -> tuple[float, float, float, float]:
    """Median seconds (manager, hand loop) and their spreads (max - min)."""
    manager = FSDP2Manager(CONFIG, mesh)
    plan = manager.plan(build(blocks))

    def run_manager() -> float:
        model = build(blocks)
        return seconds(lambda: manager.parallelize(model), collect_first=True)

    def run_hand() -> float:
        model = build(blocks)
        return seconds(lambda: by_hand(model, plan, mesh), collect_first=True)

    run_manager(), run_hand()  # warm-up: first calls pay one-off imports and caches
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(repeats):  # alternate which goes first, so drift hits both
        if i % 2 == 0:
            ours.append(run_manager())
            theirs.append(run_hand())
        else:
            theirs.append(run_hand())
            ours.append(run_manager())
    return statistics.median(ours), statistics.median(theirs), max(ours) - min(ours), max(theirs) - min(theirs)


def one_unit_per_module(model: nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """The same TP, then every module with direct parameters its own FSDP
    unit (children before parents), the root last."""
    assert plan.tensor_parallel is not None
    parallelize_module(model, tp_mesh(mesh), tp_styles_by_module(plan.tensor_parallel))
    dp = fsdp_mesh(mesh)
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    for m in reversed(owners):
        if m is not model:
            fully_shard(m, mesh=dp, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mesh=dp, mp_policy=MixedPrecisionPolicy())


def fsdp_collectives(model: nn.Module, dp_group: tuple[int, ...]) -> Counter[str]:
    """All-gathers and reduce-scatters on the data-parallel group in one
    forward + backward (TP's sequence gathers run on the tp group and are
    the same for both layouts)."""
    tokens = torch.randint(0, 256, (2, 8))
    with record_collectives() as calls:
        model(tokens).float().sum().backward()
    kinds: Counter[str] = Counter()
    for c in calls:
        if c.group != dp_group:
            continue
        if "gather" in c.op:
            kinds["all-gather"] += 1
        elif "reduce_scatter" in c.op:
            kinds["reduce-scatter"] += 1
    return kinds


def count(blocks: int, mesh: DeviceMesh) -> tuple[Counter[str], Counter[str], int, int]:
    manager = FSDP2Manager(CONFIG, mesh)
    ours = manager.parallelize(build(blocks, "cpu"))
    plan = manager.plan(build(blocks))
    theirs = build(blocks, "cpu")
    one_unit_per_module(theirs, mesh, plan)
    group = tuple(fsdp_mesh(mesh).mesh.flatten().tolist())
    units = len({id(fully_shard.state(m)) for m in theirs.modules() if isinstance(m, FSDPModule)})
    return fsdp_collectives(ours, group), fsdp_collectives(theirs, group), len(plan.units), units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--count-blocks", type=int, default=4)
    args = parser.parse_args()
    rows = []
    with fake_mesh(*MESH) as mesh:
        for blocks in args.blocks:
            ours, theirs, s_ours, s_theirs = compare(blocks, args.repeats, mesh)
            rows.append((blocks, ours, s_ours, theirs, s_theirs))
            print(f"{blocks} blocks: manager {ours:.3f} s (spread {s_ours:.3f}), hand loop {theirs:.3f} s "
                  f"(spread {s_theirs:.3f}), ratio {ours / theirs:.2f}x", flush=True)
        ours_c, theirs_c, n_ours, n_theirs = count(args.count_blocks, mesh)

    print()
    print(f"parallelize on a fake (dp=2, tp=2) mesh, SP, full AC, meta-device model; "
          f"median of {args.repeats} (GC paused, warmed up, alternating order); target <= 1.10x")
    print()
    print("| blocks | manager (s) | spread | hand loop (s) | spread | manager / hand |")
    print("|---:|---:|---:|---:|---:|---:|")
    for blocks, ours, s_ours, theirs, s_theirs in rows:
        print(f"| {blocks} | {ours:.3f} | {s_ours:.3f} | {theirs:.3f} | {s_theirs:.3f} | {ours / theirs:.2f}x |")
    print()
    print(f"FSDP collectives per training step (one forward + backward, {args.count_blocks} blocks, dp group)")
    print()
    print("| layout | FSDP units | all-gathers | reduce-scatters |")
    print("|---|---:|---:|---:|")
    print(f"| manager's plan | {n_ours} | {ours_c['all-gather']} | {ours_c['reduce-scatter']} |")
    print(f"| one unit per module | {n_theirs} | {theirs_c['all-gather']} | {theirs_c['reduce-scatter']} |")


if __name__ == "__main__":
    main()
