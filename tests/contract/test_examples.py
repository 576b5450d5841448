"""The runnable examples run: examples are documentation, and documentation
that no longer runs is worse than none."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # per example: 4 ranks importing torch on a loaded 2-core machine take minutes


def _free_port() -> int:
    """A port nothing listens on now, so parallel test runs do not meet on
    torchrun's default 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(script: str, nproc: int) -> str:
    """Run an example under torchrun on CPU; return its output, failing the
    test with that output when it exits non-zero."""
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
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        script,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script} failed (exit {result.returncode}):\n{output}"
    return output


def test_tp_sync_torchrun_example_keeps_replicas_identical() -> None:
    """Two torchrun ranks train with TP-replica gradient sync and end with
    bit-identical replicated parameters (the example checks it itself and
    exits non-zero otherwise)."""
    output = _torchrun("examples/tp_sync_torchrun.py", 2)
    assert "replicated parameters identical across TP ranks" in output, output


def test_train_torchrun_example_dp2_tp2_sp_loss_falls() -> None:
    """Four torchrun ranks (dp=2 x tp=2, sequence parallel, checkpointed)
    train through FSDP2Manager; the printed loss falls step after step."""
    output = _torchrun("examples/train_torchrun.py", 4)
    losses = [float(line.split("loss ")[1].split()[0]) for line in output.splitlines() if line.startswith("step ")]
    assert len(losses) == 8, output
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.8 * losses[0], losses


def test_compose_pipeline_example_prints_its_plan_and_trains() -> None:
    """Two torchrun ranks: the plan table (with the cross-block unit of the
    fp32 holders) is printed before anything is sharded, then three steps."""
    output = _torchrun("examples/compose_pipeline.py", 2)
    assert "cross-block  layers.{0..3}.sinks" in output, output
    assert sum(line.startswith("step ") for line in output.splitlines()) == 3, output
