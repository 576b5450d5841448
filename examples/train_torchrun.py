"""Train a small decoder with FSDP2 + tensor + sequence parallelism.

The ranks form a (world / 2) x 2 mesh: data-parallel replicas, each split
over two tensor-parallel ranks with sequence parallelism. Four processes
give two replicas::

    torchrun --nproc-per-node 4 examples/train_torchrun.py

On a node with a GPU per rank it runs on CUDA with NCCL, otherwise on CPU
with gloo (``_launch.device_and_backend``); several nodes: see
docs/launching.md.

Everything comes from fsdptx's public API: ``FSDP2Manager`` plans and
applies TP/SP, activation checkpointing and FSDP2 units; the training loop
accumulates two micro-batches under ``gradient_sync_context`` (one FSDP
reduce-scatter per step) and calls ``synchronize_tp_replica_gradients`` once
per optimizer step for the parameters that stay plain replicas on every TP
rank. Rank 0 prints the dry-run plan, then the loss of each step.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig

from _launch import device_and_backend, exit_without_teardown  # examples/ is on sys.path when run as a script

TP = 2  # tensor-parallel ranks per replica; consecutive ranks, so on one node
STEPS = 8
MICRO_BATCHES = 2
PER_RANK_BATCH = 4
SEQ_LEN = 16  # divisible by the TP size: sequence parallelism splits it
LR = 3e-3
CFG = DecoderConfig(vocab=128, dim=64, hidden=128, layers=4)


def main() -> None:
    device, backend = device_and_backend()
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % TP:
        raise SystemExit(f"train_torchrun.py needs a multiple of {TP} ranks (TP={TP}), got {world}")
    mesh = init_device_mesh(device.type, (world // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)  # the same initial weights on every rank (drawn on the CPU, then moved)
    model = Decoder(CFG).to(device)

    config = fsdptx.FSDP2Config(sequence_parallel=True, activation_checkpointing=True, mp_policy=None)
    manager = fsdptx.FSDP2Manager(config, mesh)
    if rank == 0:
        print(f"{backend} on {device.type}", flush=True)
        print(manager.plan(model), flush=True)
    manager.parallelize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    # One fixed batch per data-parallel rank, learned over the steps: the
    # loss must fall. TP ranks of one dp rank read the same samples.
    dp_rank = mesh.get_coordinate()[0]
    data = torch.randint(0, CFG.vocab, (PER_RANK_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(dp_rank))
    data = data.to(device)
    for step in range(STEPS):
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        chunks = data.chunk(MICRO_BATCHES)
        for i, chunk in enumerate(chunks):
            with fsdptx.gradient_sync_context(model, is_optimizer_step=i == len(chunks) - 1):
                logits = model(chunk[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, CFG.vocab), chunk[:, 1:].reshape(-1)) / len(chunks)
                loss.backward()
            total += loss.detach()
        synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)
        optimizer.step()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        if rank == 0:
            print(f"step {step}: loss {total.item() / mesh['dp'].size():.4f} ({synced} replicated gradients synced)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_without_teardown()
