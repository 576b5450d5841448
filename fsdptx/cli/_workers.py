"""Independent computations of one command run across worker processes.

``plan --fit`` traces each (tp, cp, checkpointing, replication) setting of
the search on its own: a single-threaded walk of fake tensors through
torch's dispatcher that neither shares nor mutates anything the others
read. The traces are most of the search's time, so on a machine with
more than one core they run side by side, one process per core.

Workers are forked: a task is a closure over the command's model builder
(often not picklable: a command-line namespace, a ``transformers``
config), which a forked worker inherits instead of unpickling, and it
starts without importing torch again. What a task returns travels back
pickled, so it must be plain data. A ``ValueError`` (a setting the
planner or the model refuses) comes back as the task's result for the
caller to report; any other exception is raised in the caller, as it
would be without workers.

While the workers run, the caller is otherwise idle: work of its own that
the tasks do not need (``--fit`` sizes its whole models exactly) runs
then, beside them, instead of before them on one core
(:func:`run_tasks_alongside`).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

__all__ = ["available_cpus", "run_tasks", "run_tasks_alongside"]

T = TypeVar("T")
R = TypeVar("R")

_TASKS: Sequence[Callable[[], object]] = ()  # what a forked worker finds by index


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _run(index: int) -> object:
    try:
        return _TASKS[index]()
    except ValueError as e:
        return e


def run_tasks(tasks: Sequence[Callable[[], T]], jobs: int, order: Sequence[int] | None = None) -> list[T | ValueError]:
    """Each task's result (or the ``ValueError`` it raised), in the order of ``tasks``.

    Args:
        tasks: calls without arguments whose results are plain data.
        jobs: processes to run them in; 1 (or a platform without
            ``fork``, or a single task) runs them here, one after another.
        order: the order to start them in (longest first balances the
            workers); default the given order.

    Raises:
        ValueError: ``jobs`` is below 1, or ``order`` is not a permutation.
        Exception: whatever a task raised but ``ValueError``.
    """
    return run_tasks_alongside(tasks, jobs, lambda: None, order)[0]


def run_tasks_alongside(
    tasks: Sequence[Callable[[], T]], jobs: int, here: Callable[[], R], order: Sequence[int] | None = None
) -> tuple[list[T | ValueError], R]:
    """:func:`run_tasks`, with ``here`` called in this process while the workers run.

    The workers are forked before ``here`` starts, so nothing it builds is
    copied into them, and the two share the machine's cores instead of
    ``here`` holding one while the other waits. With one job the tasks
    run after ``here``.

    Args:
        tasks: as :func:`run_tasks`.
        jobs: as :func:`run_tasks`.
        here: the caller's own work; it must not need the tasks' results.
        order: as :func:`run_tasks`.

    Returns:
        The tasks' results (as :func:`run_tasks`) and ``here``'s.

    Raises:
        ValueError: ``jobs`` is below 1, or ``order`` is not a permutation
            (before anything runs).
        Exception: whatever ``here`` or a task raised but a task's ``ValueError``.

    Example:
        >>> results, total = run_tasks_alongside([lambda: 1, lambda: 2], 1, lambda: sum(range(4)))
        >>> results, total
        ([1, 2], 6)
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    order = list(range(len(tasks))) if order is None else list(order)
    if sorted(order) != list(range(len(tasks))):
        raise ValueError(f"order must list each of the {len(tasks)} tasks once, got {order}")
    global _TASKS
    _TASKS = tasks
    # The tasks allocate and drop millions of small objects. Frozen, the
    # caller's heap (torch, the model builders) is left out of every full
    # collection, which would otherwise scan it again and again and, in a
    # forked worker, copy each page of it it touches (gc.freeze's own use).
    # A caller that froze its heap itself keeps it as it was.
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.freeze()
    try:
        if jobs == 1 or len(tasks) < 2 or "fork" not in multiprocessing.get_all_start_methods():
            mine = here()
            results = {i: _run(i) for i in order}
        else:
            with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                pending = pool.map(_run, order)  # submits every task: the workers are forked now
                try:
                    mine = here()
                except BaseException:
                    pool.shutdown(cancel_futures=True)  # what has not started never will
                    raise
                results = dict(zip(order, pending))
    finally:
        if ours:
            gc.unfreeze()
        _TASKS = ()
    return [results[i] for i in range(len(tasks))], mine  # type: ignore[misc]
