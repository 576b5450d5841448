"""Run one function on N local processes joined by a gloo process group.

For tests (and benchmarks) that need real collectives (FSDP2 all-gathers and
reduce-scatters, TP syncs) on CPUs, without torchrun and without a GPU::

    from fsdptx.testing import run_distributed

    def _worker(rank: int, world_size: int, scale: float) -> float:   # module level
        t = torch.full((1,), float(rank) * scale)
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce_sums_ranks() -> None:
        assert run_distributed(_worker, 2, 3.0) == [3.0, 3.0]

A 2-D mesh needs nothing special: with ``world_size=4`` the worker calls
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`` itself; the
default process group already exists when the worker runs.

Why it is built the way it is:

- ``spawn`` (not ``fork``): forking a process that already imported torch and
  started threads can deadlock, and spawn is what every platform supports. It
  costs one interpreter start plus a torch import per rank, so a test should
  spawn once and run all its steps inside one worker call.
- A fresh TCP port on 127.0.0.1 per run, so runs (and parallel test sessions)
  never meet each other's rendezvous store.
- The gloo process group gets a finite ``timeout``: a collective that one rank
  never joins raises in the waiting rank instead of hanging forever, and that
  traceback names the collective. The overall ``timeout_s`` is a backstop for
  hangs outside collectives; either way the remaining processes are killed
  and the test fails with a message saying which ranks did what.
- Results and errors travel as pickled bytes through a plain queue. Tensors
  pickled that way are copied, not shared through file descriptors, so a
  worker may exit as soon as it has reported. The traceback travels as text,
  so even an exception that cannot be pickled is reported in full.
- One thread per process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``):
  N ranks on a 2-core machine would otherwise oversubscribe the CPU and make
  collective timings (and the test's runtime) erratic.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

__all__ = ["DistributedTestError", "free_port", "run_distributed"]

T = TypeVar("T")

class DistributedTestError(AssertionError):
    """A worker raised, died, or the run timed out.

    An ``AssertionError`` subclass so pytest reports it as a test failure (with
    the worker's traceback in the message), not as an error in the harness.

    Example::

        with pytest.raises(fsdptx.testing.DistributedTestError, match="ZeroDivisionError"):
            fsdptx.testing.run_distributed(divide_by_rank, 2)
    """


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    The OS picks it (bind to port 0); the socket is closed again so rank 0's
    TCP store can bind it. Another process could take it in between, but the
    window is short and the OS does not hand the same ephemeral port out again
    immediately.

    Returns:
        The port number.

    Example::

        os.environ["MASTER_PORT"] = str(fsdptx.testing.free_port())
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _child_environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for spawned children only.

    ``spawn`` copies ``os.environ`` when a process starts, and some settings
    (``OMP_NUM_THREADS``) are read by the child's torch import, before any code
    of ours runs there. The parent's environment is restored afterwards so the
    pytest process and other tests are unaffected.
    """
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _entry(
    rank: int,
    world_size: int,
    port: int,
    collective_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    """Body of each spawned process: join the group, run ``fn``, report.

    Every outcome is reported through ``results`` so the parent never has to
    guess from an exit code. On success the ranks meet at a barrier before
    leaving: rank 0 hosts the rendezvous store, and a rank that exits early
    would pull it away from peers still finishing their last collective.
    """
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
            payload = pickle.dumps(value)
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
        sys.exit(1)
    results.put((rank, True, payload))


def _describe(outcomes: dict[int, str], world_size: int) -> str:
    return "; ".join(f"rank {r}: {outcomes.get(r, 'no report')}" for r in range(world_size))


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 30.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return
    the per-rank return values, indexed by rank.

    ``fn`` must be a module-level function (spawn pickles it by name) and its
    arguments and return value must be picklable; tensors are fine. The
    default process group is initialized before ``fn`` runs and destroyed
    after it returns.

    Raises :class:`DistributedTestError` (an ``AssertionError``) when a worker
    raises (its traceback is in the message), dies without reporting, or the
    run exceeds ``timeout_s``. On the first failure the other processes are
    killed at once: they are usually blocked in a collective the failed rank
    will never join. Keep ``collective_timeout_s`` below ``timeout_s`` so a
    hung collective surfaces as a gloo error naming it rather than as a bare
    timeout.

    Args:
        fn: ``fn(rank, world_size, *args)``, a module-level function.
        world_size: how many ranks to spawn.
        *args: further picklable arguments of ``fn``.
        timeout_s: the whole run's limit in seconds.
        collective_timeout_s: the process group's collective timeout.

    Returns:
        ``fn``'s return value on each rank, indexed by rank.

    Raises:
        DistributedTestError: a worker raised, died, or the run timed out.

    Example::

        def train(rank: int, world_size: int) -> float:
            ...
            return loss.item()

        losses = fsdptx.testing.run_distributed(train, 2)
        assert losses[0] == losses[1]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = torch_mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo otherwise binds to the address the hostname resolves to, which
        # in containers may be unresolvable or unreachable; loopback always works.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    processes = []
    try:
        with _child_environment(env):
            for rank in range(world_size):
                p = ctx.Process(
                    target=_entry,
                    args=(rank, world_size, port, collective_timeout_s, fn, args, results),
                    name=f"{getattr(fn, '__name__', 'worker')}-rank{rank}",
                    daemon=True,
                )
                p.start()
                processes.append(p)
        values: dict[int, Any] = {}
        outcomes: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue_module.Empty:
                # A process that died without reporting (segfault, os._exit,
                # OOM kill) would otherwise leave us waiting for the deadline.
                # Its queue writes are flushed before exit, so drain once more
                # before concluding that it never reported.
                dead = [
                    r
                    for r, p in enumerate(processes)
                    if p.exitcode is not None and r not in values and r not in outcomes
                ]
                if dead and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        for r in dead:
                            outcomes[r] = f"exited with code {processes[r].exitcode} without reporting"
                        for r in range(world_size):
                            if r not in values and r not in outcomes:
                                outcomes[r] = "still running, killed"
                        raise DistributedTestError(
                            f"{getattr(fn, '__name__', fn)!r} on {world_size} ranks: a worker died; "
                            + _describe(outcomes, world_size)
                        ) from None
                if time.monotonic() > deadline:
                    for r in range(world_size):
                        if r not in values and r not in outcomes:
                            outcomes[r] = "still running, killed"
                    raise DistributedTestError(
                        f"{getattr(fn, '__name__', fn)!r} on {world_size} ranks timed out after "
                        f"{timeout_s:.0f} s; " + _describe(outcomes, world_size)
                    ) from None
                continue
            if not ok:
                outcomes[rank] = "raised"
                raise DistributedTestError(
                    f"{getattr(fn, '__name__', fn)!r} failed on rank {rank} of {world_size} "
                    f"(other ranks killed); traceback from rank {rank}:\n{payload}"
                )
            assert isinstance(payload, bytes)
            values[rank] = pickle.loads(payload)
            outcomes[rank] = "returned"
        for p in processes:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(world_size)]
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=5)
        results.close()
        results.join_thread()
