"""Expert parallelism on real collectives: 4 gloo ranks train the tiny MoE
(:mod:`moe_ep_model`) 3 SGD steps with its experts split across ``ep=2``
and FSDP over the rest, and match one process training the whole model on
the whole batch.

Two MoE meshes over the same 4 ranks, in one spawn: ``dp_shard=2 x ep=2``
(each rank holds half of half the experts) and ``dp_replicate=2 x ep=2``
(HSDP: experts replicated across ``dp_replicate``). The dense mesh is
``dp=4`` and ``dp_replicate=2 x dp_shard=2`` respectively.

Why exact parity is expected: each rank's loss is the mean over its equal
quarter of the batch; the dense gradients are averaged over 4 ranks; an
expert's gradient collects, through the all-to-all's backward, the
contributions of every token routed to it from its ep group, and FSDP's
reduction over the data-parallel dims then sums the other groups' and
divides by 4 (ep x data-parallel), the same mean. Only summation order
differs, hence 1e-5 / 1e-4. A missing divide factor would make expert
gradients 2x too large, far outside the tolerance at this learning rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdptx
from fsdptx.testing import run_distributed
from moe_ep_model import EXPERTS, VOCAB, build, loss_of

WORLD = 4
PER_RANK = 2
SEQ = 9
STEPS = 3
LR = 0.5
MESHES = (
    (((4,), ("dp",)), ((2, 2), ("dp_shard", "ep"))),
    (((2, 2), ("dp_replicate", "dp_shard")), ((2, 2), ("dp_replicate", "ep"))),
)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (WORLD * PER_RANK, SEQ), generator=g) for _ in range(STEPS)]


def _train(model: torch.nn.Module, batches: list[torch.Tensor], rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in batches:
        loss = loss_of(model, tokens[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worker(rank: int, world_size: int) -> list[dict[str, Any]]:
    import torch.distributed as dist

    out = []
    for (shape, names), (moe_shape, moe_names) in MESHES:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        moe_mesh = init_device_mesh("cpu", moe_shape, mesh_dim_names=moe_names)
        model = build()
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh)
        manager.parallelize(model)
        w1 = model.layers[0].experts.w1
        assert isinstance(w1, DTensor) and w1.placements[-1] == Shard(0), w1.placements
        local = _train(model, _batches(), slice(rank * PER_RANK, (rank + 1) * PER_RANK))
        losses = torch.tensor(local)
        dist.all_reduce(losses)  # the mean over ranks is the reference's whole-batch loss
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
        out.append({"losses": (losses / world_size).tolist(), "params": params, "local_experts": w1.to_local().shape[0]})
    return out


def test_expert_parallel_training_matches_one_process() -> None:
    model = build()
    losses = _train(model, _batches(), slice(None))
    want = dict(model.named_parameters())
    results = run_distributed(_worker, WORLD, timeout_s=240.0, collective_timeout_s=60.0)
    for (_, (moe_shape, moe_names)), *per_rank in zip(MESHES, *results):
        sizes = dict(zip(moe_names, moe_shape))
        # experts per rank: EXPERTS / ep, then FSDP's split over the shard dim (1 under HSDP here)
        assert {r["local_experts"] for r in per_rank} == {EXPERTS // sizes["ep"] // sizes.get("dp_shard", 1)}
        for r in per_rank:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
            assert r["params"].keys() == want.keys()
            for name, p in want.items():
                torch.testing.assert_close(r["params"][name], p.detach(), atol=1e-4, rtol=1e-4, msg=name)
