"""Benchmark: ``audit_replicas`` against one ``synchronize_tp_replica_gradients``
call, on 2 gloo ranks (CPU), on the TP-sync benchmark's model.

Run::

    python benchmarks/audit.py [--runs 20] [--blocks 64] [--warmup 3] [--repeats 3] [--every 100]

Why: an audit that costs much more than the sync it checks would not be run
in CI or in a job. The model is ``benchmarks/tp_sync.py``'s ``ReplicatedSet``
(64 blocks x 2 norms of 4096, fp32 and bf16, a final norm, 4 sum-marked
routers: 133 TP-replicated tensors, ~2 MiB as fp32), reused from that
script, on one TP group of 2 ranks.

Method (the TP-sync benchmark's): both methods are timed interleaved, in an
order that rotates per run, each after restoring the gradients (untimed)
and a barrier, with the garbage collector paused; a timing is the slowest
rank's. The ratio audit / sync is taken per run; its median over ``--runs``
runs is reported for each of ``--repeats`` rounds, with the spread over
rounds. Also timed: an audit where every tensor drifted (all suspects, the
elementwise comparison of each), and what auditing every ``--every`` steps
adds per step (the clean audit's median over ``every``).

Prints figures; asserts nothing about them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdptx
from fsdptx.testing import record_collectives, run_distributed

from tp_sync import ReplicatedSet, interleaved_runs, quartiles, restore_grads, set_distinct_grads  # benchmarks/ is on sys.path

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 600.0


def worker(rank: int, world_size: int, runs: int, blocks: int, warmup: int, repeats: int, every: int) -> None:
    mesh: DeviceMesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    model = ReplicatedSet(blocks)
    fsdptx.broadcast_tp_replicas([model], mesh)  # the routers' random init differs per rank
    saved = set_distinct_grads(model, rank)
    n_params = sum(1 for _ in model.parameters())

    def restore() -> None:
        restore_grads(model, saved)

    def sync() -> int:
        return fsdptx.synchronize_tp_replica_gradients([model], mesh)

    def audit() -> fsdptx.ReplicaAudit:
        return fsdptx.audit_replicas([model], mesh)

    # Sanity, untimed: the parameters start equal (the sync changes only
    # gradients), so the audit is clean.
    clean = audit()
    with record_collectives() as calls:
        audit()
    n_audit = len(calls)
    restore()
    with record_collectives() as calls:
        sync()
    n_sync = len(calls)

    rounds = []
    for _ in range(repeats):
        times = interleaved_runs({"audit": audit, "sync": sync}, restore, runs, warmup)
        rounds.append(
            {
                "audit": quartiles(times["audit"]),
                "sync": quartiles(times["sync"]),
                "ratio": quartiles([a / s for a, s in zip(times["audit"], times["sync"])]),
            }
        )

    # Every tensor drifted: rank 1's parameters differ, all are suspects.
    drifted = ReplicatedSet(blocks)
    with torch.no_grad():
        for p in drifted.parameters():
            p.add_(rank)
    found = len(fsdptx.audit_replicas([drifted], mesh).drifted)
    worst = interleaved_runs({"drifted": lambda: fsdptx.audit_replicas([drifted], mesh)}, lambda: None, runs, warmup)
    if rank == 0:
        report(rounds, quartiles(worst["drifted"]), blocks=blocks, runs=runs, warmup=warmup, n_params=n_params,
               clean=clean, found=found, collectives=(n_audit, n_sync), every=every)


def report(
    rounds: list[dict[str, tuple[float, float, float]]],
    worst: tuple[float, float, float],
    *,
    blocks: int,
    runs: int,
    warmup: int,
    n_params: int,
    clean: fsdptx.ReplicaAudit,
    found: int,
    collectives: tuple[int, int],
    every: int,
) -> None:
    print(
        f"audit_replicas vs synchronize_tp_replica_gradients, gloo, {WORLD_SIZE} ranks (1 TP group), "
        f"torch {torch.__version__}\n"
        f"model: benchmarks/tp_sync.py ReplicatedSet({blocks}): {n_params} TP-replicated tensors; "
        f"clean audit: {clean}; all-drifted audit names {found} of {n_params}"
        f"{'' if found == n_params else f' (MISSED {n_params - found}: the audit is broken)'}\n"
        f"{len(rounds)} rounds of {runs} interleaved runs after {warmup} warm-up (slowest rank per timing); "
        f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    n_audit, n_sync = collectives
    print(f"collectives per call: audit {n_audit}, sync {n_sync}\n")
    print("| round | sync (ms) | audit (ms) | audit / sync, per run (q1-q3) |")
    print("|---:|---:|---:|---:|")
    for i, r in enumerate(rounds, start=1):
        ratio = r["ratio"]
        print(f"| {i} | {r['sync'][1]:.3f} | {r['audit'][1]:.3f} | {ratio[1]:.2f}x ({ratio[0]:.2f}-{ratio[2]:.2f}) |")
    medians = [r["ratio"][1] for r in rounds]
    audits = [r["audit"][1] for r in rounds]
    print(
        f"\nmedian of per-run ratios audit / sync, spread over {len(rounds)} rounds: "
        f"{min(medians):.2f}x..{max(medians):.2f}x (median {sorted(medians)[len(medians) // 2]:.2f}x)"
    )
    print(
        f"all {n_params} tensors drifted (every one compared elementwise): {worst[1]:.3f} ms "
        f"(q1-q3 {worst[0]:.3f}-{worst[2]:.3f})"
    )
    per_step = sorted(audits)[len(audits) // 2] / every
    print(f"audit_replicas_every(..., every={every}) adds {per_step * 1e3:.1f} us per optimizer step on average")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="interleaved runs per round")
    parser.add_argument("--blocks", type=int, default=64, help="blocks of ReplicatedSet (64: 133 tensors)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (spread reported)")
    parser.add_argument("--every", type=int, default=100, help="audit interval for the per-step figure")
    args = parser.parse_args(argv)
    if min(args.runs, args.blocks, args.repeats, args.every) < 1 or args.warmup < 0:
        parser.error("--runs, --blocks, --repeats and --every must be >= 1, --warmup >= 0")
    start = time.monotonic()
    run_distributed(
        worker, WORLD_SIZE, args.runs, args.blocks, args.warmup, args.repeats, args.every,
        timeout_s=JOIN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    print(f"\nwall time: {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
