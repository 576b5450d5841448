"""The traced step under expert parallelism against a real one: 4 gloo
ranks (dense ``dp_shard=4``, experts ``ep_shard=2 x ep=2``) run two
training iterations of the toy Qwen3-MoE on real CPU tensors under torch's
FSDPMemTracker, with the routing forced balanced and transformers' own
all-to-all dispatch reading its split sizes back from it
(``tests/support/ep_tracker_recipe.py``). ``fsdptx.estimate_memory`` for
the same configuration must land within the targets on every rank:
parameters, gradients and optimizer state within 1%, activations within
15%, the peak within -10%/+15%.

Measured on 2026-12-04: every figure but the peak equals the fake-mode
recipe's to the byte; the real step peaks in backward with reduce-scatter
buffers and unsharded gradients live (on fake ranks the collectives do
nothing), 4.5% above the fake recipe's peak and 4.7% above the dry run's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh, run_distributed

from ep_tracker_recipe import EXPERTS, TOP_K, EpReference, build_moe, ep_tracker_measured

WORLD, EP = 4, 2
BATCH, SEQ = 2, 64
MESH = ((WORLD,), ("dp_shard",))
MOE_MESH = ((2, EP), ("ep_shard", "ep"))


def _worker(rank: int, world_size: int) -> EpReference:
    return ep_tracker_measured(rank, BATCH, SEQ, *MESH, *MOE_MESH, FSDP2Config())


def within(value: int, reference: int, low: float, high: float) -> bool:
    return reference * (1 + low) <= value <= reference * (1 + high)


def test_a_real_four_rank_ep_step_under_the_tracker_is_within_the_targets_of_the_dry_run() -> None:
    with fake_mesh(*MESH) as mesh:
        moe = init_device_mesh("cpu", MOE_MESH[0], mesh_dim_names=MOE_MESH[1])
        with torch.device("meta"):
            model = build_moe()
        plan = fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh, moe), model, batch=BATCH, seq=SEQ)
    assert plan.expert_routing is not None and plan.expert_routing.assumption == "balanced"
    measured = run_distributed(_worker, WORLD, timeout_s=300.0, collective_timeout_s=90.0)
    per_expert = EP * BATCH * SEQ * TOP_K // EXPERTS
    for rank, ref in enumerate(measured):
        # the forced routing was balanced on the real ranks too: 2 experts
        # modules x 2 iterations, each receiving the dry run's rows
        assert ref.received_rows == (EXPERTS // EP * per_expert,) * 4 == (plan.expert_routing.recv_rows,) * 4, rank
        for name, got, want in (
            ("params", plan.params_bytes, ref.params),
            ("grads", plan.grads_bytes, ref.grads),
            ("optimizer", plan.optimizer_bytes, ref.optimizer),
        ):
            assert within(got, want, -0.01, 0.01), (rank, name, got, want)
        assert within(plan.activations_bytes, ref.activations, -0.15, 0.15), (rank, plan.activations_bytes, ref.activations)
        assert within(plan.peak_bytes, ref.peak, -0.10, 0.15), (rank, plan.peak_bytes, ref.peak)
