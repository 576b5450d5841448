"""How long the dry run and ``--fit`` take at real scale, and where the time goes.

``--fit`` traces its settings in one process per available CPU
(``--fit-jobs``); one row repeats the 256-GPU search with ``--fit-jobs 1``
as the baseline. Each timed figure is a fresh ``python -m fsdptx plan ...`` process (imports
included, as a user runs it), ``--runs`` times; the table shows the median
with the range. Targets (the sizing issue): the 80-layer Llama of 70B shapes
planned on dp=32 x tp=8 + SP within 15 s; ``--fit`` at seq 8192 on 256 x
80 GiB within 60 s and on 1,024 x 80 GiB within 90 s; DeepSeek-V3 shapes
on 256 x 141 GiB within 60 s. Then one in-process ``--fit`` per size with
timers around its parts: the traced steps (the untraced dry runs that size
the whole model run beside them, in this process), and the rest (meshes,
candidates, ranking, the report).

Run: ``PYTHONPATH=. python benchmarks/fit_scale.py [--gpus 8 64 256 1024] [--runs 3] [--skip-deepseek]``
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

LLAMA_70B = (
    "--hf",
    "llama",
    "--hf-config",
    "num_hidden_layers=80,hidden_size=8192,intermediate_size=28672,num_attention_heads=64,"
    "num_key_value_heads=8,vocab_size=128256",
)
DEEPSEEK_V3 = ("--hf", "deepseek_v3")  # fsdptx.hf's shapes: 61 layers, 256 routed experts, top-8


def _timed(argv: Sequence[str]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "fsdptx", "plan", *argv, "--json"], capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"fit_scale: {' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return wall, json.loads(done.stdout)


def _row(label: str, argv: Sequence[str], runs: int, target: float | None, count: Callable[[dict[str, Any]], str]) -> None:
    walls: list[float] = []
    last: dict[str, Any] = {}
    for _ in range(runs):
        wall, last = _timed(argv)
        walls.append(wall)
    med = statistics.median(walls)
    verdict = "" if target is None else (" met" if med <= target else " MISSED")
    goal = "" if target is None else f"{target:.0f} s"
    print(f"| {label} | {med:.1f} s | {min(walls):.1f}-{max(walls):.1f} s | {goal}{verdict} | {count(last)} |", flush=True)


def _fit_counts(data: dict[str, Any]) -> str:
    fit = data["fit"]
    meshes = fit["fitting"] + fit["not_fitting"]
    dims = sorted({k for c in meshes for k in c["mesh"]})
    return f"{fit['evaluated']} configurations ({', '.join(dims)}), {fit['fitting_total']} fit"


@contextlib.contextmanager
def _stopwatch(module: Any, name: str, totals: dict[str, float], key: Callable[[], str]) -> Iterator[None]:
    """Add the wall time of every call of ``module.name`` to ``totals[key()]`` (``key`` read as the call starts)."""
    original = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        slot = key()
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[slot] = totals.get(slot, 0.0) + time.perf_counter() - start

    setattr(module, name, timed)
    try:
        yield
    finally:
        setattr(module, name, original)


def _where(argv: Sequence[str]) -> str:
    """One in-process --fit with its pool phase (traces in worker processes, the
    whole-model dry runs here beside them) and the other dry runs timed apart."""
    from fsdptx.cli import _fit, _run
    from fsdptx.cli._main import main
    from fsdptx.cli._workers import available_cpus

    totals: dict[str, float] = {}
    phase = ["outside"]
    alongside = getattr(_fit, "run_tasks_alongside")

    def pool_phase(*args: Any, **kwargs: Any) -> Any:
        phase[0] = "beside"
        try:
            return alongside(*args, **kwargs)
        finally:
            phase[0] = "outside"

    start = time.perf_counter()
    setattr(_fit, "run_tasks_alongside", pool_phase)
    try:
        with _stopwatch(_fit, "run_tasks_alongside", totals, lambda: "pool"), _stopwatch(
            _run, "dry_run", totals, lambda: f"dry_run {phase[0]}"
        ):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                main(["plan", *argv, "--json"])
    finally:
        setattr(_fit, "run_tasks_alongside", alongside)
    total = time.perf_counter() - start
    pool = totals.get("pool", 0.0)
    beside = totals.get("dry_run beside", 0.0)
    outside = totals.get("dry_run outside", 0.0)
    rest = total - pool - outside  # the workers' own dry runs are not seen here: they are forked
    return (
        f"{total:.1f} s in process: traced steps {pool:.1f} s ({pool / total:.0%}, in {available_cpus()} "
        f"processes, the whole-model dry runs beside them here: {beside:.1f} s), other dry runs "
        f"{outside:.1f} s, the rest {rest:.1f} s ({rest / total:.0%})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--skip-deepseek", action="store_true")
    args = ap.parse_args()

    targets = {256: 60.0, 1024: 90.0}
    print("| what | median | range | target | searched |")
    print("|---|---|---|---|---|")
    _row(
        "70B plan, dp=32 x tp=8 + SP",
        [*LLAMA_70B, "--mesh", "dp=32,tp=8", "--sp"],
        args.runs,
        15.0,
        lambda d: f"{d['world_size']} ranks",
    )
    for gpus in args.gpus:
        _row(
            f"70B --fit {gpus}x80GiB, seq {args.seq}",
            [*LLAMA_70B, "--seq", str(args.seq), "--fit", f"{gpus}x80GiB"],
            args.runs,
            targets.get(gpus),
            _fit_counts,
        )
    if 256 in args.gpus:  # the baseline of the traces' worker processes, in the same run
        _row(
            f"70B --fit 256x80GiB, seq {args.seq}, --fit-jobs 1",
            [*LLAMA_70B, "--seq", str(args.seq), "--fit", "256x80GiB", "--fit-jobs", "1"],
            args.runs,
            None,
            _fit_counts,
        )
    if not args.skip_deepseek:
        _row(
            "DeepSeek-V3 --fit 256x141GiB, seq 4096, --ep 8",
            [*DEEPSEEK_V3, "--seq", "4096", "--ep", "8", "--fit", "256x141GiB"],
            args.runs,
            60.0,
            _fit_counts,
        )
    print()
    print("Where the time goes (one in-process run each):")
    for gpus in args.gpus:
        print(f"- 70B --fit {gpus}x80GiB: {_where([*LLAMA_70B, '--seq', str(args.seq), '--fit', f'{gpus}x80GiB'])}", flush=True)


if __name__ == "__main__":
    main()
