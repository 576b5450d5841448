"""run_distributed reports what happened on every rank, and never waits on a
rank that cannot finish.

Each scenario is one spawn of 2 processes: a worker that returns, one that
raises, one that vanishes (an exit code without a report, a C++-style abort),
a run past its limit, and a parent that dies under its ranks. Argument checks
run without spawning anything.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdptx.testing import DistributedTestError, run_distributed

WORLD = 2


def _sum_ranks_and_time_a_skipped_collective(rank: int, world_size: int, scale: float) -> dict[str, Any]:
    """Rank 0 enters an all-reduce on a group made after init that rank 1
    never joins; the group's timeout, not torch's 30-minute default, ends it."""
    t = torch.full((1,), float(rank) * scale)
    dist.all_reduce(t)
    group = dist.new_group(list(range(world_size)))
    out: dict[str, Any] = {"sum": t.item(), "threads": torch.get_num_threads()}
    if rank == 0:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out["skipped"] = "completed"
        except RuntimeError as e:
            out["skipped"] = type(e).__name__
        out["waited_s"] = time.monotonic() - start
    else:
        time.sleep(8.0)  # past rank 0's collective timeout, then leave without joining
    print(f"rank {rank} says hello")
    print(f"rank {rank} says goodbye", file=sys.stderr)
    return out


def test_every_rank_returns_its_value_and_a_late_group_has_the_collective_timeout(
    capfd: pytest.CaptureFixture[str],
) -> None:
    results = run_distributed(
        _sum_ranks_and_time_a_skipped_collective, WORLD, 3.0, timeout_s=120, collective_timeout_s=3
    )
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["threads"] for r in results] == [1, 1]
    assert results[0]["skipped"] == "RuntimeError"
    assert 2.5 < results[0]["waited_s"] < 8.0, results[0]["waited_s"]
    # what the ranks printed reaches the parent, rank by rank
    out, err = capfd.readouterr()
    assert out.splitlines() == ["rank 0 says hello", "rank 1 says hello"]
    assert "rank 1 says goodbye" in err


def _section(message: str, rank: int) -> str:
    """What the failure message shows of one rank: its traceback or its stderr."""
    parts = message.split("\n--- rank ")[1:]
    (section,) = [p for p in parts if p.startswith(f"{rank} ")]
    return section


def _rank_1_fails(rank: int, world_size: int, how: str) -> None:
    """Rank 1 fails as told while rank 0 waits far longer than the test may
    (in a sleep, not a collective: a peer's error on the closed connection
    would race the parent's kill)."""
    if rank == 1:
        print("rank 1 about to fail", file=sys.stderr, flush=True)
        if how == "raise":
            raise ZeroDivisionError("rank 1 divided by zero")
        if how == "exit":
            os._exit(7)
        if how == "abort":
            os.abort()
    else:
        time.sleep(120)


@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ("raise", ["rank 1 raised (other ranks killed)", "rank 1: raised", "ZeroDivisionError: rank 1 divided by zero"]),
        ("exit", ["rank 1 died", "rank 1: exited with code 7 without reporting", "rank 1 about to fail"]),
        ("abort", ["rank 1 died", "exited with code -6 (SIGABRT) without reporting", "Fatal Python error: Aborted"]),
    ],
)
def test_a_failing_rank_is_reported_with_its_cause_and_its_blocked_peer_is_killed_at_once(
    how: str, expected: list[str]
) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_rank_1_fails, WORLD, how, timeout_s=300, collective_timeout_s=60)
    message = str(caught.value)
    for needle in expected:
        assert needle in message, message
    # rank 0 was waiting in the all-reduce: killed, with its stack showing where
    assert "rank 0: still running, killed" in message
    assert "in _rank_1_fails" in _section(message, 0)
    assert time.monotonic() - start < 60, "the blocked peer was waited for"


def _sleep_past_the_deadline(rank: int, world_size: int) -> None:
    dist.barrier()
    time.sleep(600)


def test_a_run_past_its_limit_fails_with_the_stacks_of_the_ranks_still_running() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as caught:
        run_distributed(_sleep_past_the_deadline, WORLD, timeout_s=40, collective_timeout_s=30)
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "timed out after 40 s" in message
    for rank in range(WORLD):
        assert f"rank {rank}: still running, killed" in message
        assert "in _sleep_past_the_deadline" in _section(message, rank), message
    assert elapsed < 60, elapsed


_ORPHAN_PARENT = textwrap.dedent(
    """
    import sys
    sys.path[:0] = {path!r}
    from fsdptx.testing import run_distributed
    from test_gloo_runner import _report_pid_then_wait
    run_distributed(_report_pid_then_wait, 2, {folder!r}, timeout_s=300, collective_timeout_s=200)
    """
)


def _report_pid_then_wait(rank: int, world_size: int, folder: str) -> None:
    dist.barrier()
    (Path(folder) / f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.skipif(os.name != "posix", reason="kills the parent with SIGKILL")
def test_ranks_leave_when_their_parent_is_killed(tmp_path: Path) -> None:
    here = str(Path(__file__).parent)
    code = _ORPHAN_PARENT.format(path=[here, *sys.path], folder=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 240
        pids: list[int] = []
        while time.monotonic() < deadline and len(pids) < WORLD and parent.poll() is None:
            time.sleep(0.2)
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid")) if p.read_text()]
        assert len(pids) == WORLD, f"ranks never started (parent exit code {parent.poll()})"
    finally:
        parent.kill()
        parent.wait(timeout=30)
    gone_by = time.monotonic() + 30
    while time.monotonic() < gone_by and any(_alive(p) for p in pids):
        time.sleep(0.2)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    assert survivors == [], "ranks outlived their parent"


# ------------------------------------------------------------ argument checks


def _never_called(rank: int, world_size: int) -> None:
    raise AssertionError("a refused run spawned a rank")


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"world_size": 0}, ValueError, "world_size must be >= 1"),
        ({"world_size": True}, TypeError, "world_size"),
        ({"world_size": 2.0}, TypeError, "world_size"),
        ({"timeout_s": -1.0}, ValueError, "timeout_s"),
        ({"timeout_s": math.inf}, ValueError, "timeout_s"),
        ({"collective_timeout_s": math.nan}, ValueError, "collective_timeout_s"),
        ({"collective_timeout_s": "5"}, TypeError, "collective_timeout_s"),
        ({"timeout_s": 10.0, "collective_timeout_s": 10.0}, ValueError, r"collective_timeout_s \(10.0\) must be below"),
        ({"fn": "worker"}, TypeError, "fn must be a module-level function"),
        ({"fn": lambda rank, world_size: None}, TypeError, "must be picklable"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument_before_any_rank_starts(
    kwargs: dict[str, Any], error: type[Exception], named: str
) -> None:
    call: dict[str, Any] = {"fn": _never_called, "world_size": WORLD, **kwargs}
    with pytest.raises(error, match=rf"run_distributed: .*{named}|run_distributed: {named}"):
        run_distributed(call.pop("fn"), call.pop("world_size"), **call)
