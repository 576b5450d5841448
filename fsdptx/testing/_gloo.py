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

- Each rank is a fresh interpreter (``subprocess``, prepared like a
  ``multiprocessing`` spawn child, so ``fn`` is found by the same import path
  as in the parent): forking a process that already imported torch and
  started threads can deadlock. It costs one interpreter start plus a torch
  import per rank, so a test should spawn once and run all its steps inside
  one worker call.
- Each rank's stdout and stderr go to files of their own from the moment the
  interpreter starts. A rank that dies without reporting (a C++ abort, a
  segfault, the OOM killer, an error before the worker ran) is reported with
  its exit code and the end of its stderr, where the abort message or
  Python's fault handler put the cause. The logs are copied to the parent's
  stdout and stderr afterwards, rank by rank.
- The rendezvous store lives in the parent (the OS picks its port). No rank
  has to outlive the others to keep it up, no port is chosen and then bound
  by someone else, and joining waits up to the whole run's limit: ranks that
  start seconds apart on a loaded machine still meet.
- Every process group the worker makes gets the finite
  ``collective_timeout_s``, the mesh's sub-groups included: a collective that
  one rank never joins raises in the waiting rank, with a traceback naming
  it, instead of hanging. ``timeout_s`` is the backstop for hangs outside
  collectives; then every rank still running is asked for its Python stacks
  (``faulthandler``, on ``SIGUSR1``) before it is killed, and the stacks are
  part of the error.
- Teardown is the same on every rank and every run: the ranks meet through
  the store when all have returned, destroy the process group, meet again,
  write their result and leave with ``os._exit``. Nobody closes its sockets
  while a peer is still inside a collective, and the interpreter's final
  cleanup, where FSDP2 on gloo can abort a process that did everything right
  (see ``examples/_launch.py``), never runs. A worker that raises reports its
  traceback and leaves at once; its peers are killed, since they are usually
  blocked in a collective it will never join.
- A rank whose parent disappears leaves too (it watches its stdin, a pipe the
  parent holds), so an interrupted test session leaves no process behind.
- One thread per process (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``):
  N ranks on a 2-core machine would otherwise oversubscribe the CPU and make
  collective timings (and the test's runtime) erratic.
"""

from __future__ import annotations

import faulthandler
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

__all__ = ["DistributedTestError", "free_port", "run_distributed"]

T = TypeVar("T")

# The first code a rank runs: before anything is imported from fsdptx, the
# parent's import path, working directory and main module are restored, so
# the fsdptx (and the test module) the rank imports are the parent's.
_BOOTSTRAP = (
    "import pickle, sys\n"
    "from multiprocessing import spawn\n"
    "job, rank = sys.argv[1], int(sys.argv[2])\n"
    "with open(job, 'rb') as f:\n"
    "    spawn.prepare(pickle.load(f))\n"
    "from fsdptx.testing._gloo import _rank_main\n"
    "_rank_main(job, rank)\n"
)
_GRACE_S = 2.0  # after a first failure: time for near-simultaneous ones to land
_STACKS_S = 1.0  # after SIGUSR1: time for a rank to write its stacks
_POLL_S = 0.05
_TAIL_LINES = 40


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

    The OS picks it (bind to port 0); the socket is closed again so the caller
    can bind it. Another process could take it in between, but the window is
    short and the OS does not hand the same ephemeral port out again
    immediately.

    Returns:
        The port number.

    Example::

        os.environ["MASTER_PORT"] = str(fsdptx.testing.free_port())
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ----------------------------------------------------------------- the rank


@dataclass(frozen=True)
class _Settings:
    """What every rank of one run is started with (plain data: it is read
    before the worker's module can be imported)."""

    world_size: int
    store_port: int
    timeout_s: float
    collective_timeout_s: float


def _exit_with_parent() -> None:
    """Leave when the parent's end of our stdin closes: the parent died (or
    was killed) without getting to kill us."""
    sys.stdin.buffer.read()
    sys.stderr.write("run_distributed: the parent process is gone; leaving\n")
    sys.stderr.flush()
    os._exit(3)


def _meet(store: Any, stage: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """Wait until every rank has reached ``stage``, through the parent's store
    (a gloo barrier would be bounded by the collective timeout, and the
    slowest rank may take longer than that to finish its work)."""
    store.set(f"run_distributed/{stage}/{rank}", "1")
    store.wait([f"run_distributed/{stage}/{r}" for r in range(world_size)], timeout)


def _write_report(path: Path, ok: bool, body: bytes) -> None:
    """Write the outcome whole or not at all: the parent reads a report only
    once the process is gone, and a half-written one must not look like one."""
    part = path.with_suffix(".part")
    part.write_bytes(pickle.dumps((ok, body)))
    os.replace(part, path)


def _rank_main(job: str, rank: int) -> NoReturn:
    """Body of each rank: join the group, run ``fn``, tear down, report, leave.

    Every outcome the worker can still influence goes into the report file;
    the exit code says only whether it did (0) or raised (1).
    """
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_exit_with_parent, name="run_distributed-parent-watch", daemon=True).start()
    torch.set_num_threads(1)
    report = Path(job).with_name(f"rank{rank}.result")
    ok, body = False, b""
    try:
        with open(job, "rb") as f:
            pickle.load(f)  # the preparation, applied by the bootstrap
            settings: _Settings = pickle.load(f)
            fn, args = pickle.load(f)
        run_limit = timedelta(seconds=settings.timeout_s)
        collective_limit = timedelta(seconds=settings.collective_timeout_s)
        # Groups made later (a mesh's dp and tp groups) take torch's default
        # timeout, 30 minutes for gloo, unless told otherwise: this process
        # exists only for this run, so its default is the run's.
        dist.distributed_c10d.default_pg_timeout = collective_limit
        # public, but re-exported by torch.distributed without an explicit "as"
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", settings.store_port, None, False, timeout=run_limit
        )
        world_size = settings.world_size
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=collective_limit)
        value = fn(rank, world_size, *args)
        payload = pickle.dumps(value)
        _meet(store, "returned", rank, world_size, run_limit)
        if dist.is_initialized():
            dist.destroy_process_group()
        _meet(store, "destroyed", rank, world_size, run_limit)
        ok, body = True, payload
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        body = traceback.format_exc().encode()
    try:
        _write_report(report, ok, body)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)


# --------------------------------------------------------------- the parent


@dataclass
class _Rank:
    """One spawned rank as the parent sees it."""

    rank: int
    process: subprocess.Popen[bytes]
    stdout: Path
    stderr: Path
    report: Path
    state: str = "running"  # running | returned | raised | died | killed
    value: Any = None
    detail: str = ""

    def settle(self) -> None:
        """Read the outcome of a rank whose process has exited."""
        code = self.process.returncode
        if not self.report.exists():
            self.state = "died"
            self.detail = f"exited with {_exit_code(code)} without reporting"
            if hasattr(signal, "SIGUSR1") and code == -signal.SIGUSR1:
                # asked for its stacks before its fault handler was set up
                self.detail += " (still starting when asked for its stacks)"
            return
        ok, body = pickle.loads(self.report.read_bytes())
        if not ok:
            self.state = "raised"
            self.detail = "raised:\n" + body.decode(errors="replace")
        elif code != 0:
            self.state = "died"
            self.detail = f"reported a result, then exited with {_exit_code(code)}"
        else:
            self.state = "returned"
            self.value = pickle.loads(body)

    def tail(self) -> str:
        """The end of this rank's stderr."""
        try:
            lines = self.stderr.read_text(errors="replace").splitlines()
        except OSError:
            return "(no stderr file)"
        if not lines:
            return "(stderr is empty)"
        cut = lines[-_TAIL_LINES:]
        return ("...\n" if len(lines) > len(cut) else "") + "\n".join(cut)


def _exit_code(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


def _signal_ranks(ranks: list[_Rank], sig: int) -> None:
    """Send ``sig`` to each still-running rank and everything it started."""
    for r in ranks:
        if r.process.poll() is None:
            try:
                if os.name == "posix":
                    os.killpg(r.process.pid, sig)
                else:
                    r.process.send_signal(sig)
            except (ProcessLookupError, PermissionError):
                pass  # exited meanwhile


def _stop(ranks: list[_Rank], *, ask_for_stacks: bool) -> None:
    """Kill every rank still running, after asking for its stacks if told to,
    and wait for each to be gone."""
    running = [r for r in ranks if r.process.poll() is None]
    if ask_for_stacks and running and hasattr(signal, "SIGUSR1"):
        _signal_ranks(running, signal.SIGUSR1)
        time.sleep(_STACKS_S)
        for r in running:
            if r.process.poll() is not None:  # it ended meanwhile: what it says counts
                r.settle()
        running = [r for r in running if r.state == "running"]
    _signal_ranks(running, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
    for r in running:
        try:
            r.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            r.detail = "would not die after SIGKILL"
        if r.state == "running":
            r.state = "killed"


def _failure_message(name: str, ranks: list[_Rank], headline: str) -> str:
    lines = [f"{name} on {len(ranks)} ranks: {headline}"]
    for r in ranks:
        summary = {
            "returned": "returned",
            "raised": "raised (traceback below)",
            "died": r.detail,
            "killed": "still running, killed" + (f" ({r.detail})" if r.detail else ""),
            "running": "still running",
        }[r.state]
        lines.append(f"  rank {r.rank}: {summary}")
    for r in ranks:
        if r.state == "raised":
            lines.append(f"--- rank {r.rank} {r.detail}")
        elif r.state in ("died", "killed"):
            lines.append(f"--- rank {r.rank} stderr, last lines:\n{r.tail()}")
    return "\n".join(lines)


def _forward_logs(ranks: list[_Rank]) -> None:
    """Copy each rank's output to ours, rank by rank (pytest then shows it
    with a failing test; a benchmark's report printed by rank 0 reaches the
    terminal)."""
    for r in ranks:
        for path, stream in ((r.stdout, sys.stdout), (r.stderr, sys.stderr)):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text:
                stream.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        sys.stderr.flush()


def _check_arguments(fn: object, world_size: object, timeout_s: object, collective_timeout_s: object) -> None:
    if not callable(fn):
        raise TypeError(f"run_distributed: fn must be a module-level function, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"run_distributed: world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    for label, value in (("timeout_s", timeout_s), ("collective_timeout_s", collective_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"run_distributed: {label} must be a number of seconds, got {type(value).__name__}")
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"run_distributed: {label} must be a positive finite number of seconds, got {value}")
    assert isinstance(timeout_s, (int, float)) and isinstance(collective_timeout_s, (int, float))
    if collective_timeout_s >= timeout_s:
        raise ValueError(
            f"run_distributed: collective_timeout_s ({collective_timeout_s}) must be below timeout_s ({timeout_s}), "
            "so that a hung collective fails with gloo's error naming it before the run is killed"
        )


def _child_environment() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in env:
        # gloo otherwise binds to the address the hostname resolves to, which
        # in containers may be unresolvable or unreachable; loopback always works.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _preparation() -> dict[str, Any]:
    """What ``multiprocessing.spawn.prepare`` needs to make a fresh
    interpreter import like this one: the import path (``''`` made absolute),
    the working directory, and the main module when ``fn`` may live there (a
    script run as ``python benchmarks/x.py``). Built here rather than by
    ``spawn.get_preparation_data``, which would also fix this process's
    multiprocessing start method as a side effect."""
    cwd = os.getcwd()
    data: dict[str, Any] = {"sys_path": [p if p else cwd for p in sys.path], "sys_argv": list(sys.argv), "dir": cwd}
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    main_path = getattr(main, "__file__", None)
    if spec_name is not None:
        data["init_main_from_name"] = spec_name
    elif main_path is not None:
        data["init_main_from_path"] = os.path.abspath(main_path)
    return data


def _start(rank: int, job: Path, env: dict[str, str]) -> _Rank:
    folder = job.parent
    out, err = folder / f"rank{rank}.stdout", folder / f"rank{rank}.stderr"
    with open(out, "wb") as out_file, open(err, "wb") as err_file:
        process = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", _BOOTSTRAP, str(job), str(rank)],
            stdin=subprocess.PIPE,
            stdout=out_file,
            stderr=err_file,
            env=env,
            close_fds=True,
            start_new_session=os.name == "posix",
        )
    return _Rank(rank, process, out, err, folder / f"rank{rank}.result")


def _watch(ranks: list[_Rank], deadline: float) -> str | None:
    """Wait until every rank has returned (``None``), or one failed or the
    deadline passed (then the headline of the failure)."""
    while True:
        for r in ranks:
            if r.state == "running" and r.process.poll() is not None:
                r.settle()
        if all(r.state == "returned" for r in ranks):
            return None
        failed = [r for r in ranks if r.state in ("raised", "died")]
        if failed:
            # A rank that died often takes its peers' connections with it;
            # give their errors a moment, so the first cause is among those shown.
            end = time.monotonic() + _GRACE_S
            while time.monotonic() < end and any(r.state == "running" for r in ranks):
                time.sleep(_POLL_S)
                for r in ranks:
                    if r.state == "running" and r.process.poll() is not None:
                        r.settle()
            failed = [r for r in ranks if r.state in ("raised", "died")]
            died = [r for r in failed if r.state == "died"]
            first = (died or failed)[0]
            what = "died" if first.state == "died" else "raised"
            return f"rank {first.rank} {what} (other ranks killed)"
        if time.monotonic() > deadline:
            return "timed out"
        time.sleep(_POLL_S)


def run_distributed(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 30.0,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return
    the per-rank return values, indexed by rank.

    ``fn`` must be a module-level function (each rank imports it by name) and
    its arguments and return value must be picklable; tensors are fine. The
    default process group is initialized before ``fn`` runs and destroyed
    after it returns on every rank.

    Raises :class:`DistributedTestError` (an ``AssertionError``) when a worker
    raises (its traceback is in the message), dies without reporting (its
    exit code and the end of its stderr are), or the run exceeds
    ``timeout_s`` (the Python stacks of the ranks still running are). On the
    first failure the other processes are killed: they are usually blocked in
    a collective the failed rank will never join. ``collective_timeout_s``
    must be below ``timeout_s``, so a hung collective surfaces as a gloo
    error naming it rather than as a bare timeout.

    Args:
        fn: ``fn(rank, world_size, *args)``, a module-level function.
        world_size: how many ranks to spawn.
        *args: further picklable arguments of ``fn``.
        timeout_s: the whole run's limit in seconds, joining included.
        collective_timeout_s: the collective timeout of every process group
            the run makes.

    Returns:
        ``fn``'s return value on each rank, indexed by rank.

    Raises:
        TypeError: ``fn`` is not callable or not picklable with ``args``, or
            an argument has the wrong type.
        ValueError: ``world_size`` below 1, a timeout not positive and
            finite, or ``collective_timeout_s`` not below ``timeout_s``.
        DistributedTestError: a worker raised, died, or the run timed out.

    Example::

        def train(rank: int, world_size: int) -> float:
            ...
            return loss.item()

        losses = fsdptx.testing.run_distributed(train, 2)
        assert losses[0] == losses[1]
    """
    _check_arguments(fn, world_size, timeout_s, collective_timeout_s)
    name = repr(getattr(fn, "__qualname__", fn))
    try:
        task = pickle.dumps((fn, args))
    except Exception as e:  # noqa: BLE001 - pickling raises many kinds
        raise TypeError(
            f"run_distributed: fn {name} and its args must be picklable (fn defined at module level): {e}"
        ) from e
    store = dist.TCPStore(  # type: ignore[attr-defined]  # public; see _rank_main
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    ranks: list[_Rank] = []
    try:
        with tempfile.TemporaryDirectory(prefix="fsdptx-gloo-") as folder:
            job = Path(folder) / "job.pickle"
            with open(job, "wb") as f:
                pickle.dump(_preparation(), f)
                pickle.dump(_Settings(world_size, store.port, float(timeout_s), float(collective_timeout_s)), f)
                f.write(task)
            env = _child_environment()
            deadline = time.monotonic() + timeout_s
            try:
                ranks.extend(_start(rank, job, env) for rank in range(world_size))
                headline = _watch(ranks, deadline)
                if headline == "timed out":
                    headline = f"timed out after {timeout_s:g} s; the stacks of the ranks still running are below"
                _stop(ranks, ask_for_stacks=headline is not None)
            finally:
                _stop(ranks, ask_for_stacks=False)
                for r in ranks:
                    if r.process.stdin is not None:
                        r.process.stdin.close()
                _forward_logs(ranks)
            if headline is not None:
                raise DistributedTestError(_failure_message(name, ranks, headline))
            return [r.value for r in ranks]
    finally:
        del store
