"""Soak: run gloo test files again and again under a parallel CPU load and
count the runs that fail.

Run::

    python benchmarks/gloo_soak.py [--runs 20] [--burners 2] [FILES ...]

A multi-rank gloo test that passes alone can still lose a rank when the
machine is oversubscribed (a rank starved past a timeout, a teardown race).
This starts ``--burners`` processes that spin on the CPU for the whole soak,
then runs ``python -m pytest -q -p no:cacheprovider FILES`` ``--runs`` times
in a row, each in a fresh interpreter (as CI does), and prints per run its
exit code, wall time and pytest's summary line, then the failure count. The
default files are the replica audit's and the TP sync agreement's gloo
specs (the audit is the run that once lost a rank under load). It prints figures and asserts
nothing; exit code 0 whatever the count.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("tests/tp/test_replica_audit_gloo.py", "tests/tp/test_sync_agreement_gloo.py")


def _burn() -> None:
    """Spin until killed: one core's worth of competing load."""
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2**31


def _summary(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES))
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--burners", type=int, default=2)
    args = parser.parse_args()
    if args.runs < 1 or args.burners < 0:
        parser.error("--runs must be >= 1 and --burners >= 0")
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    failures, times = 0, []
    print(f"gloo soak: {args.runs} runs of {' '.join(args.files)} under {args.burners} CPU burners "
          f"on {os.cpu_count()} cores")
    try:
        for run in range(1, args.runs + 1):
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.files],
                cwd=ROOT, capture_output=True, text=True,
            )
            took = time.perf_counter() - start
            times.append(took)
            failures += proc.returncode != 0
            print(f"run {run:2d}: exit {proc.returncode}, {took:6.1f} s, {_summary(proc.stdout)}", flush=True)
            if proc.returncode != 0:
                print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(f"failed runs: {failures} of {args.runs}; wall per run median {statistics.median(times):.1f} s, "
          f"min {min(times):.1f} s, max {max(times):.1f} s; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
