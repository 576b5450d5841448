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
"""

from __future__ import annotations

import gc
import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

__all__ = ["available_cpus", "run_tasks"]

T = TypeVar("T")

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
        ValueError: ``jobs`` is below 1.
        Exception: whatever a task raised but ``ValueError``.
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
            results = {i: _run(i) for i in order}
        else:
            with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
                results = dict(zip(order, pool.map(_run, order)))
    finally:
        if ours:
            gc.unfreeze()
        _TASKS = ()
    return [results[i] for i in range(len(tasks))]  # type: ignore[misc]
