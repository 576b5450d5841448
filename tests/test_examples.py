"""The runnable examples run: examples are documentation, and documentation
that no longer runs is worse than none."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


def _free_port() -> int:
    """A port nothing listens on now, so parallel test runs do not meet on
    torchrun's default 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tp_sync_torchrun_example_keeps_replicas_identical() -> None:
    """Two torchrun ranks train with TP-replica gradient sync and end with
    bit-identical replicated parameters (the example checks it itself and
    exits non-zero otherwise)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if sys.platform.startswith("linux"):
        # gloo binds to the address the hostname resolves to, which in
        # containers may be unreachable; loopback always works.
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "examples/tp_sync_torchrun.py",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"example failed (exit {result.returncode}):\n{output}"
    assert "replicated parameters identical across TP ranks" in output, output
