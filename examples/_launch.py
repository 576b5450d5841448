"""Shared by the torchrun examples (run as ``examples/X.py``, so this
directory is on ``sys.path``)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def device_and_backend() -> tuple[torch.device, str]:
    """CUDA with NCCL when every rank on this node gets a GPU of its own,
    else CPU with gloo.

    torchrun sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``. NCCL does not run
    two ranks on one GPU, so four ranks on a one-GPU machine take the CPU
    path, as on a machine without a GPU; ``FSDPTX_EXAMPLE_DEVICE=cpu`` forces
    it. Every rank of a node decides the same way (same count, same
    variable), so no group mixes backends. On CUDA the rank's device is made
    current before the process group exists, as NCCL needs.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    wanted = os.environ.get("FSDPTX_EXAMPLE_DEVICE", "auto")
    if wanted not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"FSDPTX_EXAMPLE_DEVICE must be auto, cpu or cuda, got {wanted!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fits = gpus >= local_world and dist.is_nccl_available()
    if wanted == "cuda" and not fits:
        raise SystemExit(
            f"FSDPTX_EXAMPLE_DEVICE=cuda: {local_world} ranks on this node need as many GPUs "
            f"and NCCL; found {gpus} GPU(s), NCCL {'available' if dist.is_nccl_available() else 'missing'}"
        )
    if wanted != "cpu" and fits:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def exit_without_teardown(code: int = 0) -> None:
    """Leave the process once the work is done and the group is destroyed.

    With torch 2.13, FSDP2 on gloo can abort the interpreter's final cleanup
    ("terminate called without an active exception", SIGABRT) after
    everything succeeded; plain torch reproduces it in 2 of 12 runs. Skipping
    that cleanup, after flushing output, keeps the exit code meaning what
    the job did (``code``). ``fsdptx.testing.run_distributed`` ends its ranks
    the same way.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
