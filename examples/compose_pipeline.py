"""Shard a mixed-dtype decoder with the composed pipeline and train a few steps.

Run with two processes (CUDA with NCCL when each has a GPU, else CPU with gloo):

    torchrun --nproc-per-node 2 examples/compose_pipeline.py

Every block mixes fp32 master weights, an fp32 attention-sink holder that must
compute in fp32, and a bf16 gate. Plain per-block ``fully_shard`` stops at
FSDP2's "uniform original parameter dtype" assertion; the plan below gives
each storage dtype its own unit and puts all blocks' sinks in one unit.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig

from _launch import device_and_backend, exit_without_teardown  # examples/ is on sys.path when run as a script


def main() -> None:
    device, backend = device_and_backend()
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank (drawn on the CPU, then moved)
    model = Decoder(
        DecoderConfig(vocab=64, dim=32, hidden=64, layers=4, fp32_holders=True, sibling_dtype=torch.bfloat16)
    ).to(device)

    # Pure: plan and print without touching the model.
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    plan = fsdptx.plan(model, pipeline)  # mp_policy=None: no mixed precision, the same numbers on CPU and GPU
    if rank == 0:
        print(plan)

    # The one effectful step.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    fsdptx.apply_plan(plan, model, mesh)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)  # each data-parallel rank sees its own batch
    tokens = torch.randint(0, 64, (4, 16)).to(device)
    for step in range(3):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reported = loss.detach().clone()
        dist.all_reduce(reported)
        if rank == 0:
            print(f"step {step}: mean loss {reported.item() / dist.get_world_size():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    exit_without_teardown()
