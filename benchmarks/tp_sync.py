"""Benchmark: TP-replica gradient synchronization on 2 gloo ranks (CPU).

Run::

    python benchmarks/tp_sync.py [--runs 20] [--blocks 64] [--warmup 3] [--repeats 3]

Why this benchmark exists: under sequence parallelism every TP rank holds full
copies of the norm weights, biases and router weights, and each copy gets a
different gradient. A naive implementation issues one all-reduce per
parameter: a Llama-like model has ~130 such tensors of a few KiB each, so the
step pays ~130 collective latencies for ~2 MiB of data.
``fsdptx.synchronize_tp_replica_gradients`` packs them into flat fp32 buffers
instead. This script measures how close that gets to the floor (one
all-reduce of one pre-packed fp32 buffer of the same size, plus copying the
gradients in and out of it) and how much it gains over the per-parameter
loop, and checks the memory bound of the chunked path.

It prints measured figures next to the targets; it is not a test and asserts
nothing about them. Timings on a shared 2-core machine over loopback gloo are
noisy and latency-dominated; on NCCL the per-collective launch latency (and so
the gain) is different.

Method:

- 2 processes (``torch.multiprocessing`` spawn) join a gloo group on a free
  127.0.0.1 port, with a finite collective timeout and a join timeout on the
  parent, so a hang ends the script instead of blocking it.
- Both ranks form one TP group: a 1-D mesh ``("tp",)`` of size 2.
- The methods (fsdptx, the floor, the per-parameter loop and, to read the
  overhead by, fsdptx's agreement all-to-all alone) are timed interleaved:
  each run times every one, one after the other, in an order that rotates
  from run to run, so a slow spell of the shared machine hits all of them
  alike. Each timing starts from the same distinct per-rank gradients
  (restored outside the timed region) after a ``dist.barrier()``, with the
  garbage collector paused. A timing is the slowest rank's (what a
  training step waits for).
- The ratios are taken per run (fsdptx over the floor of the same run,
  per-parameter over fsdptx of the same run) and their median over
  ``--runs`` runs, after ``--warmup`` untimed runs, is reported for each of
  ``--repeats`` consecutive rounds, with the spread across rounds.
"""

from __future__ import annotations

import argparse
import functools
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
from fsdptx.core._sizes import format_bytes
from fsdptx.testing import record_collectives, run_distributed

from _timing import seconds  # benchmarks/ is on sys.path when run as a script

WORLD_SIZE = 2
NORM_DIM = 4096
ROUTERS = 4
ROUTER_SHAPE = (8, NORM_DIM)  # n_experts x dim, like a MoE gate
BIG_NUMEL = 2**20  # the one tensor larger than the memory budget below
MEMORY_BUDGET = 2**20  # max_bytes for the memory measurement: 1 MiB < 4 MiB of BIG
COLLECTIVE_TIMEOUT_S = 60.0
JOIN_TIMEOUT_S = 300.0

TARGET_SPEEDUP = 10.0
TARGET_LIMIT_RATIO = 1.3  # issue 20: the median over rounds of fsdptx / floor


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


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """The parameters' gradients, in ``model.parameters()`` order (every
    parameter has one once ``set_distinct_grads`` ran)."""
    return [g for p in model.parameters() if (g := p.grad) is not None]


def restore_grads(model: nn.Module, saved: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), saved):
        assert p.grad is not None
        p.grad.copy_(g)


# ------------------------------------------------------------------ the three methods


def per_parameter_all_reduce(model: ReplicatedSet, group: dist.ProcessGroup, size: int) -> None:
    """The baseline a careful hand-written loop would be: one all-reduce per
    gradient, low-precision ones upcast to fp32 and cast back, ``mean`` ones
    divided by the group size. Same numerics as fsdptx, different packing."""
    sums = {id(b.router.weight) for b in model.layers if isinstance(b, Block) and b.router is not None}
    for p in model.parameters():
        g = p.grad
        assert g is not None
        work = g.float() if g.dtype != torch.float32 else g
        dist.all_reduce(work, group=group)
        if id(p) not in sums:
            work.div_(size)
        if work is not g:
            g.copy_(work)


def pre_packed_floor(grads: list[torch.Tensor], group: dist.ProcessGroup) -> Callable[[], None]:
    """The floor: what no packing can avoid. One fp32 buffer for every
    gradient with views into it prepared once (as fsdptx's cached plan keeps
    them); a call copies the gradients in (casting bf16 up), all-reduces the
    buffer once and copies them back out (casting down). No division, no
    agreement, no bookkeeping: those are what fsdptx is measured on."""
    numels = [g.numel() for g in grads]
    staging = torch.empty(sum(numels))
    views = [v.view(g.shape) for v, g in zip(staging.split(numels), grads)]

    def floor() -> None:
        torch._foreach_copy_(views, grads)
        dist.all_reduce(staging, group=group)
        torch._foreach_copy_(grads, views)

    return floor


def total_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- timing


def interleaved_runs(
    methods: dict[str, Callable[[], object]], before: Callable[[], None], runs: int, warmup: int
) -> dict[str, list[float]]:
    """Per method, the slowest rank's wall time (ms) in each of ``runs`` runs.

    Each run times every method once; the order rotates by one from run to
    run, so each method takes each position in turn. Before each timing ``before``
    (restoring grads) runs untimed and a barrier lines the ranks up, so a
    timing measures the call, not one rank waiting for the other's restore.
    gloo collectives on CPU tensors issued without ``async_op`` complete
    before they return, so a method returning means its work is done. The per-rank times
    are combined with one MAX all-reduce after the last run.
    """
    names = list(methods)
    times: list[list[float]] = [[] for _ in names]
    for i in range(warmup + runs):
        for k in range(len(names)):
            j = (i + k) % len(names)
            before()
            dist.barrier()
            elapsed = seconds(methods[names[j]])
            if i >= warmup:
                times[j].append(elapsed * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(zip(names, slowest.tolist()))


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile (one value: itself thrice)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def summarize(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Quartiles of each method's times and of the two per-run ratios: the
    ratio of two methods timed in the same run, where a slow spell of the
    machine slows both, is steadier than the ratio of their medians."""
    summary = {name: quartiles(values) for name, values in times.items()}
    summary["ratio"] = quartiles([s / f for s, f in zip(times["fsdptx"], times["floor"])])
    summary["speedup"] = quartiles([b / s for b, s in zip(times["per-param"], times["fsdptx"])])
    return summary


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
    agreement all-to-all), agree wait (what is left of the agreement after
    the pack), collective (the data all-reduce), unpack (sums scaled into
    means, copy out).
    """
    from fsdptx.tp.sync import _agreement, _context, _layout, _ops, _schedule

    pc = time.perf_counter_ns
    rows: dict[str, list[int]] = {k: [] for k in PHASES}
    where = "synchronize_tp_replica_gradients"
    for i in range(warmup + runs):
        before()
        dist.barrier()
        marks: dict[str, int] = {}
        t0 = pc()
        parts, max_bytes = _context._check_arguments(where, [model], mesh, "tp", fsdptx.DEFAULT_MAX_BUFFER_BYTES)
        ctx = _layout._tp_context(mesh, "tp", _layout._cache_of(parts[0]))
        assert ctx is not None
        layout = _layout._layout(parts, ctx, max_bytes, "sync", with_buffers=False)
        t1 = pc()
        states, grads, deviations, sparse = _ops._grad_states(layout, ctx)
        plan = layout.schedule
        assert plan is not None and plan.key == states + "\n".join(deviations).encode(), "run the function first"
        plan.materialize()
        synced = plan.synced
        tensors = grads if len(synced) == len(grads) else [grads[j] for j in synced]
        t2 = pc()

        def agree() -> Callable[[], None]:
            finish = _agreement._agree(where, ctx, layout, max_bytes, plan.call_digest, states, deviations, sparse, None)

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
            _schedule._execute(plan, tensors, collective, float(len(ctx.ranks)), agree)
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


def worker(rank: int, world_size: int, runs: int, blocks: int, warmup: int, repeats: int) -> None:
    """One rank (the gloo group is set up by ``run_distributed``, one process
    per rank): build the model, time the methods, measure memory; rank 0
    prints."""
    mesh: DeviceMesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")

    model = ReplicatedSet(blocks)
    saved = set_distinct_grads(model, rank)
    numel = total_numel(model)

    def restore() -> None:
        restore_grads(model, saved)

    def sync() -> int:
        return fsdptx.synchronize_tp_replica_gradients([model], mesh)

    def baseline() -> None:
        per_parameter_all_reduce(model, group, WORLD_SIZE)

    floor = pre_packed_floor(grads_of(model), group)

    # For reading the overhead only: fsdptx first agrees on what to reduce
    # with one all-to-all of 4 int64 per rank pair (see _agree), a latency no
    # packing of the data removes.
    sent = torch.zeros(4 * WORLD_SIZE, dtype=torch.int64)
    received = torch.zeros(4 * WORLD_SIZE, dtype=torch.int64)

    def agreement() -> None:
        dist.all_to_all_single(received, sent, group=group)

    # Sanity, untimed: both methods compute the same thing.
    restore()
    synced = sync()
    ours = [g.clone() for g in grads_of(model)]
    restore()
    baseline()
    same = all(torch.equal(a, b) for a, b in zip(ours, grads_of(model)))

    restore()
    n_sync = count_collectives(sync)
    restore()
    n_base = count_collectives(baseline)
    restore()
    n_floor = count_collectives(floor)

    methods: dict[str, Callable[[], object]] = {
        "fsdptx": sync, "floor": floor, "per-param": baseline, "agreement": agreement,
    }
    rounds = [summarize(interleaved_runs(methods, restore, runs, warmup)) for _ in range(repeats)]

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
            functools.partial(fsdptx.synchronize_tp_replica_gradients, [mem_model], mesh, max_bytes=budget)
        )
        worst = torch.tensor([peak], dtype=torch.int64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        peaks[label] = int(worst.item())

    if rank == 0:
        report(
            rounds, [ph for ph in every_rank if ph is not None], peaks,
            blocks=blocks, runs=runs, warmup=warmup, numel=numel, mem_total=mem_total,
            n_params=sum(1 for _ in model.parameters()), synced=synced, same=same,
            collectives=(n_sync, n_base, n_floor),
        )


def report(
    rounds: list[dict[str, tuple[float, float, float]]],
    phases: list[dict[str, float]],
    peaks: dict[str, int],
    *,
    blocks: int,
    runs: int,
    warmup: int,
    numel: int,
    mem_total: int,
    n_params: int,
    synced: int,
    same: bool,
    collectives: tuple[int, int, int],
) -> None:
    """Print the figures as Markdown tables, targets next to them."""
    print(
        f"TP-replica gradient sync, gloo, {WORLD_SIZE} ranks (1 TP group), torch {torch.__version__}\n"
        f"model: {blocks} blocks x 2 norms ({NORM_DIM}, fp32 + bf16) + final norm + "
        f"{ROUTERS} sum-marked routers {ROUTER_SHAPE}: {n_params} grads, {numel:,} elements "
        f"({format_bytes(numel * 4)} as fp32); {synced} synchronized; "
        f"results equal to baseline: {same}\n"
        f"{len(rounds)} rounds of {runs} interleaved runs after {warmup} warm-up (slowest rank per timing); "
        f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
    )
    n_sync, n_base, n_floor = collectives
    print(f"collectives per call: fsdptx {n_sync}, per-parameter {n_base}, floor {n_floor}\n")
    print(
        "| round | floor (ms) | fsdptx (ms) | per-param (ms) | agreement all-to-all (ms) | "
        "fsdptx / floor, per run (q1-q3) | per-param / fsdptx, per run (q1-q3) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rounds, start=1):
        ratio, speedup = r["ratio"], r["speedup"]
        print(
            f"| {i} | {r['floor'][1]:.3f} | {r['fsdptx'][1]:.3f} | {r['per-param'][1]:.1f} | "
            f"{r['agreement'][1]:.3f} | {ratio[1]:.2f}x ({ratio[0]:.2f}-{ratio[2]:.2f}) | "
            f"{speedup[1]:.1f}x ({speedup[0]:.1f}-{speedup[2]:.1f}) |"
        )
    ratios = [r["ratio"][1] for r in rounds]
    speedups = [r["speedup"][1] for r in rounds]
    over_rounds = statistics.median(ratios)
    ratio_met = "met" if over_rounds <= TARGET_LIMIT_RATIO else "NOT met"
    speedup_met = "met" if min(speedups) >= TARGET_SPEEDUP else "NOT met"
    print(
        f"\nmedians of per-run ratios, spread over {len(rounds)} rounds: "
        f"fsdptx / floor {min(ratios):.2f}x..{max(ratios):.2f}x, median over rounds {over_rounds:.2f}x "
        f"(target <= {TARGET_LIMIT_RATIO}x: {ratio_met}); "
        f"per-param / fsdptx {min(speedups):.1f}x..{max(speedups):.1f}x "
        f"(target >= {TARGET_SPEEDUP:.0f}x in every round: {speedup_met})"
    )
    print(
        "floor = one pre-packed fp32 all_reduce + one foreach copy in and one out; fsdptx adds "
        "its agreement all-to-all (timed alone in its column), turning sums into means and local bookkeeping; "
        "times are medians"
    )
    print(
        f"\nPer-phase breakdown of one fsdptx call (median us over {runs} runs, per rank; "
        "pack overlaps the agreement all-to-all, 'agree wait' is what is left of it):\n"
    )
    print("| rank | " + " | ".join(PHASES) + " |")
    print("|---:|" + "---:|" * len(PHASES))
    for r_, ph in enumerate(phases):
        print(f"| {r_} | " + " | ".join(f"{ph[k]:.0f}" for k in PHASES) + " |")
    print(
        f"\nPeak extra CPU memory of synchronize_tp_replica_gradients (torch allocator, "
        f"profiler memory events; gloo's internal buffers not included), same set plus one "
        f"{BIG_NUMEL:,}-element fp32 tensor ({format_bytes(mem_total)} of grads as fp32):\n"
    )
    print("| max_bytes | peak extra memory | target |")
    print("|---:|---:|---|")
    print(
        f"| {format_bytes(MEMORY_BUDGET)} | {format_bytes(peaks['budget'])} ({peaks['budget']:,} B) | "
        f"<= {format_bytes(MEMORY_BUDGET)} ({MEMORY_BUDGET:,} B) |"
    )
    print(
        f"| {format_bytes(fsdptx.DEFAULT_MAX_BUFFER_BYTES)} (default) | {format_bytes(peaks['default'])} "
        f"({peaks['default']:,} B) | (contrast: one buffer for everything) |"
    )
    sys.stdout.flush()


# --------------------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="interleaved runs per round (median ratio reported)")
    parser.add_argument("--blocks", type=int, default=64, help="transformer blocks (2 norm weights each)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    parser.add_argument(
        "--repeats", type=int, default=3, help="consecutive rounds of interleaved runs (spread reported)"
    )
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
