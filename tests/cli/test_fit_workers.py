"""``--fit`` traces its settings in worker processes (``--fit-jobs``): the
result is the same at any number of them, each task's refusal comes back
as its result, and anything else a task raises reaches the caller."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.cli._workers import available_cpus, run_tasks, run_tasks_alongside

# cp and pp candidates as well as plain and HSDP meshes, dp_shard=8 derived from the reference pair
SEARCH = ("--preset", "llama", "--layers", "2", "--batch", "2", "--seq", "256", "--fit", "8x8GiB", "--fit-cp", "2", "--fit-pp", "2")


def _fit(*extra: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", *SEARCH, *extra, "--json"]) == 0
    return json.loads(out.getvalue())["fit"]  # type: ignore[no-any-return]


def test_the_search_lists_the_same_candidates_whatever_the_number_of_worker_processes() -> None:
    alone, shared = _fit("--fit-jobs", "1"), _fit("--fit-jobs", "3")
    assert alone == shared
    assert {k for c in alone["fitting"] + alone["not_fitting"] for k in c["mesh"]} >= {"dp_replicate", "cp", "pp"}


def _pid() -> int:
    return os.getpid()


def _refuse() -> int:
    raise ValueError("tp=3 does not divide")


def _break() -> int:
    raise KeyError("lost")


def test_results_come_back_in_the_order_of_the_tasks_from_other_processes() -> None:
    tasks = [_pid, _refuse, _pid, _pid]
    results = run_tasks(tasks, 2, order=[3, 2, 1, 0])
    assert isinstance(results[1], ValueError) and str(results[1]) == "tp=3 does not divide"
    pids = {r for r in results if isinstance(r, int)}
    assert len(results) == 4 and os.getpid() not in pids


def test_one_job_runs_the_tasks_here() -> None:
    assert run_tasks([_pid, _pid], 1) == [os.getpid(), os.getpid()]


def test_an_error_that_is_not_a_refusal_reaches_the_caller() -> None:
    with pytest.raises(KeyError, match="lost"):
        run_tasks([_pid, _break], 2)


@pytest.mark.parametrize(("jobs", "order", "says"), [(0, None, "jobs must be >= 1"), (2, [0, 0], "each of the 2 tasks once")])
def test_bad_arguments_are_refused_before_any_task_runs(jobs: int, order: list[int] | None, says: str) -> None:
    ran: list[int] = []
    with pytest.raises(ValueError, match=says):
        run_tasks([lambda: ran.append(1), lambda: ran.append(2)], jobs, order)
    assert ran == []


def test_the_callers_own_work_runs_here_while_the_tasks_run_in_other_processes() -> None:
    results, mine = run_tasks_alongside([_pid, _refuse, _pid], 2, _pid)
    assert mine == os.getpid()
    assert isinstance(results[1], ValueError)
    assert os.getpid() not in {r for r in results if isinstance(r, int)}


def test_with_one_job_the_callers_work_comes_first_then_the_tasks_in_order() -> None:
    ran: list[str] = []
    results, mine = run_tasks_alongside(
        [lambda: ran.append("a") or 1, lambda: ran.append("b") or 2], 1, lambda: ran.append("here") or 0, order=[1, 0]
    )
    assert (ran, results, mine) == (["here", "b", "a"], [1, 2], 0)


def test_when_the_callers_work_fails_the_tasks_not_yet_started_never_start(tmp_path: Path) -> None:
    def task(i: int) -> int:
        (tmp_path / str(i)).touch()
        time.sleep(0.3)
        return i

    def fail() -> None:
        raise KeyError("the whole model")

    tasks = [functools.partial(task, i) for i in range(20)]
    with pytest.raises(KeyError, match="the whole model"):
        run_tasks_alongside(tasks, 2, fail)
    started = len(list(tmp_path.iterdir()))
    assert 1 <= started < len(tasks)  # those running (or handed to a worker) finish, the rest are dropped


def test_the_default_is_the_cpus_this_process_may_use() -> None:
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_fit_jobs_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama", "--layers", "2", "--fit", "4x8GiB", "--fit-jobs", "0"]) == 2
    assert "--fit-jobs must be >= 1, got 0" in capsys.readouterr().err


def _frozen() -> int:
    import gc

    return gc.get_freeze_count()


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_callers_heap_is_frozen_while_tasks_run_and_thawed_after(jobs: int) -> None:
    import gc

    assert gc.get_freeze_count() == 0
    counts = run_tasks([_frozen, _frozen], jobs)
    assert all(n > 0 for n in counts)  # a forked worker inherits the frozen heap
    assert gc.get_freeze_count() == 0


def test_a_caller_that_froze_its_heap_keeps_it_frozen() -> None:
    import gc

    gc.freeze()
    try:
        before = gc.get_freeze_count()
        run_tasks([_frozen, _frozen], 1)
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
