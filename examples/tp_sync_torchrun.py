"""Keep TP-replicated parameters identical across a tensor-parallel group.

Two processes forming one TP group, on CUDA with NCCL when each has a GPU,
else on CPU with gloo::

    torchrun --nproc-per-node 2 examples/tp_sync_torchrun.py

Why this is needed: with sequence parallelism each TP rank runs the norms
(and biases, routers) on its own slice of the tokens, so the copies of those
parameters that every TP rank holds get a *different* gradient on each rank.
If each rank stepped its optimizer on its own gradient, the copies would
drift apart after the first step. ``fsdptx.synchronize_tp_replica_gradients``
reduces those gradients across the TP group once per optimizer step.

To stay short and runnable on a CPU, this example does not shard any weight with TP:
every parameter is a TP replica and each rank gets a different slice of the
batch, which gives replicated parameters rank-specific gradients exactly as
sequence parallelism does. In a real TP model the sharded weights (DTensors
with ``Shard`` on the "tp" mesh dim) are recognised and left alone by the
same call; only the replicas are reduced.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig

from _launch import device_and_backend, exit_without_teardown  # examples/ is on sys.path when run as a script

STEPS = 5
GLOBAL_BATCH = 8  # split evenly over the TP ranks
SEQ_LEN = 16
LR = 1e-2
MAX_GRAD_NORM = 1.0


def replica_checksum(model: torch.nn.Module) -> torch.Tensor:
    """One fp64 number summarising all parameters, weighted by position so
    that swapped or offset values do not cancel out. Equal on all ranks iff
    (for practical purposes) the replicas are identical."""
    device = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, p in enumerate(model.parameters()):
        flat = p.detach().double().reshape(-1)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device) + i
        total += (flat * weights).sum()
    return total


def main() -> None:
    # torchrun provides RANK, WORLD_SIZE, MASTER_ADDR/PORT. A finite timeout
    # turns a collective that one rank never joins into an error, not a hang.
    device, backend = device_and_backend()
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    # The whole world is one TP group: a 1-D mesh whose only axis is named
    # "tp", the axis name fsdptx looks for by default.
    mesh: DeviceMesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))

    # Seed per rank on purpose: ranks that initialize independently start
    # with different replicas (the situation after a careless init or a
    # rank-local load).
    torch.manual_seed(1000 + rank)
    cfg = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2)
    model = Decoder(cfg).to(device)

    # Once, after init/loading and before training: make every replica equal
    # to TP rank 0's copy. Synchronizing gradients only keeps equal replicas
    # equal; it cannot repair replicas that already differ.
    n = fsdptx.broadcast_tp_replicas([model], mesh)
    if rank == 0:
        print(f"{backend} on {device.type}; broadcast {n} replicated tensors from TP rank 0")

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = torch.Generator().manual_seed(0)  # same global batch on every rank
    per_rank = GLOBAL_BATCH // world
    for step in range(STEPS):
        tokens = torch.randint(cfg.vocab, (GLOBAL_BATCH, SEQ_LEN + 1), generator=data).to(device)
        mine = tokens[rank * per_rank : (rank + 1) * per_rank]  # a different slice per rank
        logits = model(mine[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), mine[:, 1:].reshape(-1))

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # After backward (and after all gradient accumulation micro-steps),
        # before anything reads the gradients: clipping must see the reduced
        # gradient (the same norm on every rank, hence the same clip factor),
        # and the optimizer must step every replica with the same update.
        # Exactly once per optimizer step: "sum"-marked gradients (e.g.
        # routers, marked with fsdptx.mark_tp_replica_gradient_reduction)
        # would be double counted by a second call. Here every parameter
        # uses the default "mean": each rank's loss is a mean over its own
        # equal share of the batch, so the mean of the per-rank gradients is
        # the gradient of the mean loss over the whole batch.
        synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # for printing only: the loss over the whole batch
        if rank == 0:
            print(f"step {step}: loss {mean_loss.item() / world:.4f} ({synced} gradients synchronized)")

    # Check: gather every rank's checksum and compare. Identical replicas
    # give bit-identical checksums (same values, same summation order).
    sums = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(sums, replica_checksum(model))
    identical = all(torch.equal(s, sums[0]) for s in sums)
    if rank == 0:
        print(f"checksums per rank: {[f'{s.item():.6f}' for s in sums]}")
        print("replicated parameters identical across TP ranks" if identical else "replicas DIFFER across TP ranks")
    dist.destroy_process_group()
    exit_without_teardown(0 if identical else 1)


if __name__ == "__main__":
    # One thread per rank: torchrun starts several processes on one machine.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    main()
