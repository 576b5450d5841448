"""Benchmark: TP-replica gradient synchronization on 2 gloo ranks (CPU).

Run::

    python benchmarks/tp_sync.py [--runs 20] [--blocks 64] [--warmup 3]

Why this benchmark exists: under sequence parallelism every TP rank holds full
copies of the norm weights, biases and router weights, and each copy gets a
different gradient. A naive implementation issues one all-reduce per
parameter: a Llama-like model has ~130 such tensors of a few KiB each, so the
step pays ~130 collective latencies for ~2 MiB of data.
``fsdptx.synchronize_tp_replica_gradients`` packs them into flat fp32 buffers
instead. This script measures how close that gets to the floor (one
all-reduce of one pre-packed buffer of the same size) and how much it gains
over the per-parameter loop, and checks the memory bound of the chunked path.

It prints measured figures next to the targets; it is not a test and asserts
nothing about them. Timings on a shared 2-core machine over loopback gloo are
noisy and latency-dominated; on NCCL the per-collective launch latency (and so
the gain) is different.

Method:

- 2 processes (``torch.multiprocessing`` spawn) join a gloo group on a free
  127.0.0.1 port, with a finite collective timeout and a join timeout on the
  parent, so a hang ends the script instead of blocking it.
- Both ranks form one TP group: a 1-D mesh ``("tp",)`` of size 2.
- Each timed run starts from the same distinct per-rank gradients (restored
  outside the timed region), after a ``dist.barrier()``. A run's time is the
  slowest rank's (what a training step waits for); the median over ``--runs``
  runs after ``--warmup`` untimed runs is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import ProfilerActivity, profile

import fsdptx
from fsdptx.testing import record_collectives, run_distributed

WORLD_SIZE = 2
NORM_DIM = 4096
ROUTERS = 4
ROUTER_SHAPE = (8, NORM_DIM)  # n_experts x dim, like a MoE gate
BIG_NUMEL = 2**20  # the one tensor larger than the memory budget below
MEMORY_BUDGET = 2**20  # max_bytes for the memory measurement: 1 MiB < 4 MiB of BIG
COLLECTIVE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 300.0

TARGET_SPEEDUP = 10.0
TARGET_LIMIT_RATIO = 1.5


# --------------------------------------------------------------------------- model


class Norm(nn.Module):
    """A norm weight holder: replicated on every TP rank under SP. No forward
    is needed, the benchmark sets gradients directly."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(NORM_DIM, dtype=dtype))


class Block(nn.Module):
    """Two norms per block: fp32 ``attn_norm`` and bf16 ``mlp_norm``, so half
    the replicated norm weights are low precision (reduced in fp32, cast back)."""

    def __init__(self, with_router: bool) -> None:
        super().__init__()
        self.attn_norm = Norm(torch.float32)
        self.mlp_norm = Norm(torch.bfloat16)
        self.router: nn.Linear | None = None
        if with_router:
            # Each TP rank routes only its sequence shard: disjoint partial
            # contributions, which are summed, not averaged.
            self.router = nn.Linear(ROUTER_SHAPE[1], ROUTER_SHAPE[0], bias=False)
            fsdptx.mark_tp_replica_gradient_reduction(self.router, "sum")


class ReplicatedSet(nn.Module):
    """The TP-replicated parameters of a Llama-like model with ``blocks``
    blocks: 2 norms per block, the final norm, and ``ROUTERS`` router weights
    spread over the blocks. With ``big``, one extra 1M-element replicated
    tensor, larger than the memory budget, so the chunked path must cut it."""

    def __init__(self, blocks: int, big: bool = False) -> None:
        super().__init__()
        every = max(1, blocks // ROUTERS)
        self.layers = nn.ModuleList(Block(i % every == 0 and i // every < ROUTERS) for i in range(blocks))
        self.norm = Norm(torch.float32)
        self.big = nn.Parameter(torch.zeros(BIG_NUMEL)) if big else None


def set_distinct_grads(model: nn.Module, rank: int) -> list[torch.Tensor]:
    """Give every parameter a rank-dependent gradient; return copies to restore
    before each timed run (``sum`` reductions are not idempotent, and every run
    should reduce the same values)."""
    gen = torch.Generator().manual_seed(1234 + rank)
    saved = []
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        saved.append(p.grad.clone())
    return saved


def restore_grads(model: nn.Module, saved: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), saved):
        assert p.grad is not None
        p.grad.copy_(g)


# ------------------------------------------------------------------ the three methods


def per_parameter_all_reduce(model: ReplicatedSet, group: dist.ProcessGroup, size: int) -> None:
    """The baseline a careful hand-written loop would be: one all-reduce per
    gradient, low-precision ones upcast to fp32 and cast back, ``mean`` ones
    divided by the group size. Same numerics as fsdptx, different packing."""
    sums = {id(layer.router.weight) for layer in model.layers if layer.router is not None}
    for p in model.parameters():
        g = p.grad
        assert g is not None
        work = g.float() if g.dtype != torch.float32 else g
        dist.all_reduce(work, group=group)
        if id(p) not in sums:
            work.div_(size)
        if work is not g:
            g.copy_(work)


def total_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- timing


def time_runs(
    fn: Callable[[], object], before: Callable[[], None], runs: int, warmup: int, device: torch.device
) -> float:
    """Median over ``runs`` of the slowest rank's wall time of ``fn()``, in ms.

    ``before`` (restoring grads) runs untimed; the barrier lines the ranks up
    so a run measures the collective, not one rank waiting for the other to
    finish its restore. gloo collectives on CPU tensors are synchronous
    (``async_op=False``), so ``fn()`` returning means the reduction is done.
    """
    times: list[float] = []
    for i in range(warmup + runs):
        before()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist()) * 1e3


def count_collectives(fn: Callable[[], object]) -> int:
    with record_collectives() as calls:
        fn()
    return len(calls)


# --------------------------------------------------------------------------- phases


PHASES = ("validate", "grads", "pack", "agree wait", "collective", "unpack", "total")


def phase_breakdown(
    model: nn.Module, mesh: DeviceMesh, before: Callable[[], None], runs: int, warmup: int
) -> dict[str, float]:
    """Median per-phase time (us) of one rank's synchronize_tp_replica_gradients,
    re-running its steps with timers between them (``time.perf_counter_ns``).

    It mirrors the public function step by step through the module's private
    helpers, so it must follow that function when it changes. Phases:
    validate (arguments, TP context, layout cache check), grads (gradient
    states, plan lookup), pack (copy in of the first chunk, overlapping the
    agreement all-reduce), agree wait (what is left of the agreement after
    the pack), collective (the data all-reduce), unpack (division of the
    means and copy out).
    """
    from fsdptx.tp import _replicas as r

    pc = time.perf_counter_ns
    rows: dict[str, list[int]] = {k: [] for k in PHASES}
    where = "synchronize_tp_replica_gradients"
    for i in range(warmup + runs):
        before()
        dist.barrier()
        marks: dict[str, int] = {}
        t0 = pc()
        parts, max_bytes = r._check_arguments(where, [model], mesh, "tp", fsdptx.DEFAULT_MAX_BUFFER_BYTES)
        ctx = r._tp_context(mesh, "tp")
        assert ctx is not None
        layout = r._layout(parts, ctx, max_bytes, "sync", with_buffers=False)
        t1 = pc()
        states, grads, deviations, sparse = r._grad_states(layout, ctx)
        plan = layout.plan
        assert plan is not None and plan.key == states + "\n".join(deviations).encode(), "run the function first"
        plan.materialize()
        synced = plan.synced
        tensors = grads if len(synced) == len(grads) else [grads[j] for j in synced]
        t2 = pc()

        def agree() -> Callable[[], None]:
            finish = r._agree(where, ctx, layout, max_bytes, plan.call_digest, states, deviations, sparse)

            def timed() -> None:
                marks["wait"] = pc()
                finish()
                marks["agreed"] = pc()

            return timed

        def collective(buf: torch.Tensor) -> None:
            marks["coll"] = pc()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=ctx.group)
            marks["unpack"] = pc()

        with torch.no_grad():
            r._execute(plan, tensors, collective, float(len(ctx.ranks)), agree)
        t3 = pc()
        if i >= warmup:
            for k, v in (
                ("validate", t1 - t0), ("grads", t2 - t1), ("pack", marks["wait"] - t2),
                ("agree wait", marks["coll"] - marks["wait"]), ("collective", marks["unpack"] - marks["coll"]),
                ("unpack", t3 - marks["unpack"]), ("total", t3 - t0),
            ):
                rows[k].append(v)
    return {k: statistics.median(v) / 1e3 for k, v in rows.items()}


# --------------------------------------------------------------------------- memory


def peak_extra_cpu_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes allocated minus freed through torch's CPU allocator
    while ``fn()`` runs, relative to the start of the call.

    Method (torch 2.13): with ``profile_memory=True`` the profiler records one
    ``"[memory]"`` event per allocation (positive ``nbytes()``) and per free
    (negative) made by the c10 CPU allocator. ``FunctionEvent.cpu_memory_usage``
    and ``key_averages()`` only give, per op, the *net* bytes of the memory
    events inside the op's interval (and double count nested ops), which is
    no peak: an op that allocates a buffer and frees it nets 0. So this reads
    the raw kineto events (``prof.profiler.kineto_results.events()``), keeps
    the CPU ``"[memory]"`` ones, orders them by timestamp (a stable sort keeps
    record order for equal timestamps) and takes the maximum of the running
    sum. A tensor allocated before the call and freed during it shows as a
    negative step, so the figure is "extra" memory beyond what existed.

    Not measured: memory that does not go through torch's allocator, notably
    gloo's own transport buffers (malloc'd inside gloo). The profiler records
    memory events only on profiled threads: a tensor whose last reference
    is dropped by gloo's worker thread is freed there unrecorded, so it
    counts as alive to the end of the call. That errs upwards (the figure
    stays an upper bound), and it is real: until that thread lets go, the
    memory is held.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        raise RuntimeError("profiler returned no kineto results")
    cpu_types = {torch.autograd.DeviceType.CPU}
    memory = [e for e in results.events() if e.name() == "[memory]" and e.device_type() in cpu_types]
    memory.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in memory:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


# --------------------------------------------------------------------------- worker


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def worker(rank: int, world_size: int, runs: int, blocks: int, warmup: int, repeats: int) -> None:
    """One rank (the gloo group is set up by ``run_distributed``, one thread
    per rank): build the model, time the three methods, measure memory; rank 0
    prints."""
    mesh: DeviceMesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    device = torch.device("cpu")

    model = ReplicatedSet(blocks)
    saved = set_distinct_grads(model, rank)
    numel = total_numel(model)
    packed = torch.randn(numel)  # the limit: already packed, already fp32

    def restore() -> None:
        restore_grads(model, saved)

    def sync() -> int:
        return fsdptx.synchronize_tp_replica_gradients([model], mesh)

    def baseline() -> None:
        per_parameter_all_reduce(model, group, WORLD_SIZE)

    def limit() -> None:
        dist.all_reduce(packed, group=group)

    # For the breakdown only: fsdptx first agrees on what to reduce with
    # one all-reduce of 8 int64 (see _agree), so its own floor is the
    # limit plus this latency.
    meta = torch.zeros(8, dtype=torch.int64)

    def metadata() -> None:
        dist.all_reduce(meta, op=dist.ReduceOp.MAX, group=group)

    # Sanity, untimed: both methods compute the same thing.
    restore()
    synced = sync()
    ours = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    restore()
    baseline()
    same = all(torch.equal(a, p.grad) for a, p in zip(ours, model.parameters()))

    restore()
    n_sync = count_collectives(sync)
    restore()
    n_base = count_collectives(baseline)
    n_limit = count_collectives(limit)

    # The floor: the pre-packed all-reduce plus the copies no packing can
    # avoid, one copy in and one copy out (casting bf16 up and back down),
    # into views prepared once, as fsdptx's cached plan does.
    grads = [p.grad for p in model.parameters()]
    staging = torch.empty(numel)
    views = [v.view(g.shape) for v, g in zip(staging.split([g.numel() for g in grads]), grads)]  # type: ignore[union-attr]

    def copies() -> None:
        torch._foreach_copy_(views, grads)  # type: ignore[arg-type]
        torch._foreach_copy_(grads, views)  # type: ignore[arg-type]

    rounds: list[dict[str, float]] = []
    for _ in range(repeats):
        t_sync = time_runs(sync, restore, runs, warmup, device)
        t_base = time_runs(baseline, restore, runs, warmup, device)
        t_limit = time_runs(limit, lambda: None, runs, warmup, device)
        t_copy = time_runs(copies, lambda: None, runs, warmup, device)
        t_meta = time_runs(metadata, lambda: None, runs, warmup, device)
        rounds.append(
            {"sync": t_sync, "base": t_base, "limit": t_limit, "copy": t_copy, "meta": t_meta,
             "floor": t_limit + t_copy}
        )

    restore()
    sync()  # the breakdown reuses the cached plan of the last call
    phases = phase_breakdown(model, mesh, restore, runs, warmup)
    every_rank: list[dict[str, float] | None] = [None] * world_size
    dist.all_gather_object(every_rank, phases)

    # Memory: the same set plus one 1M-element fp32 tensor (4 MiB), with a
    # 1 MiB budget; and, for contrast, the default 256 MiB budget, where
    # everything travels in one buffer.
    mem_model = ReplicatedSet(blocks, big=True)
    mem_saved = set_distinct_grads(mem_model, rank)
    mem_total = total_numel(mem_model) * 4
    peaks: dict[str, int] = {}
    for label, budget in (("budget", MEMORY_BUDGET), ("default", fsdptx.DEFAULT_MAX_BUFFER_BYTES)):
        restore_grads(mem_model, mem_saved)
        dist.barrier()
        peak = peak_extra_cpu_bytes(
            lambda b=budget: fsdptx.synchronize_tp_replica_gradients([mem_model], mesh, max_bytes=b)
        )
        worst = torch.tensor([peak], dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        peaks[label] = int(worst.item())

    if rank == 0:
        n_params = sum(1 for _ in model.parameters())
        print(
            f"TP-replica gradient sync, gloo, {WORLD_SIZE} ranks (1 TP group), torch {torch.__version__}\n"
            f"model: {blocks} blocks x 2 norms ({NORM_DIM}, fp32 + bf16) + final norm + "
            f"{ROUTERS} sum-marked routers {ROUTER_SHAPE}: {n_params} grads, {numel:,} elements "
            f"({fmt_bytes(numel * 4)} as fp32); {synced} synchronized; "
            f"results equal to baseline: {same}\n"
            f"median of {runs} runs after {warmup} warm-up (slowest rank per run); "
            f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
        )
        print(f"collectives per call: fsdptx {n_sync}, per-parameter {n_base}, pre-packed {n_limit}\n")
        print(
            "| run | floor (ms) | fsdptx (ms) | per-param (ms) | fsdptx / floor | per-param / fsdptx |"
            " metadata all-reduce (ms) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for i, r in enumerate(rounds, start=1):
            print(
                f"| {i} | {r['floor']:.3f} ({r['limit']:.3f} + {r['copy']:.3f}) | {r['sync']:.3f} | "
                f"{r['base']:.3f} | {r['sync'] / r['floor']:.2f}x | {r['base'] / r['sync']:.1f}x | {r['meta']:.3f} |"
            )
        ratios = [r["sync"] / r["floor"] for r in rounds]
        speedups = [r["base"] / r["sync"] for r in rounds]
        print(
            f"\nspread over {len(rounds)} runs: fsdptx / floor {min(ratios):.2f}x..{max(ratios):.2f}x "
            f"(target <= {TARGET_LIMIT_RATIO}x in every run: {'met' if max(ratios) <= TARGET_LIMIT_RATIO else 'NOT met'}); "
            f"per-param / fsdptx {min(speedups):.1f}x..{max(speedups):.1f}x "
            f"(target >= {TARGET_SPEEDUP:.0f}x in every run: {'met' if min(speedups) >= TARGET_SPEEDUP else 'NOT met'})"
        )
        print(
            "floor = one pre-packed fp32 all_reduce + one foreach copy in and one out; fsdptx adds "
            "its agreement all-reduce (metadata column) and local bookkeeping"
        )
        print(
            f"\nPer-phase breakdown of one fsdptx call (median us over {runs} runs, per rank; "
            "pack overlaps the agreement all-reduce, 'agree wait' is what is left of it):\n"
        )
        print("| rank | " + " | ".join(PHASES) + " |")
        print("|---:|" + "---:|" * len(PHASES))
        for r_, ph in enumerate(every_rank):
            assert ph is not None
            print(f"| {r_} | " + " | ".join(f"{ph[k]:.0f}" for k in PHASES) + " |")
        print(
            f"\nPeak extra CPU memory of synchronize_tp_replica_gradients (torch allocator, "
            f"profiler memory events; gloo's internal buffers not included), same set plus one "
            f"{BIG_NUMEL:,}-element fp32 tensor ({fmt_bytes(mem_total)} of grads as fp32):\n"
        )
        print("| max_bytes | peak extra memory | target |")
        print("|---:|---:|---|")
        print(
            f"| {fmt_bytes(MEMORY_BUDGET)} | {fmt_bytes(peaks['budget'])} ({peaks['budget']:,} B) | "
            f"<= {fmt_bytes(MEMORY_BUDGET)} ({MEMORY_BUDGET:,} B) |"
        )
        print(
            f"| {fmt_bytes(fsdptx.DEFAULT_MAX_BUFFER_BYTES)} (default) | {fmt_bytes(peaks['default'])} "
            f"({peaks['default']:,} B) | (contrast: one buffer for everything) |"
        )
        sys.stdout.flush()


# --------------------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="timed runs per method (median reported)")
    parser.add_argument("--blocks", type=int, default=64, help="transformer blocks (2 norm weights each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    parser.add_argument("--repeats", type=int, default=3, help="consecutive measurement rounds (spread reported)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.blocks < 1 or args.warmup < 0 or args.repeats < 1:
        parser.error("--runs, --blocks and --repeats must be >= 1, --warmup >= 0")

    start = time.monotonic()
    run_distributed(
        worker,
        WORLD_SIZE,
        args.runs,
        args.blocks,
        args.warmup,
        args.repeats,
        timeout_s=JOIN_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    print(f"\nwall time: {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
