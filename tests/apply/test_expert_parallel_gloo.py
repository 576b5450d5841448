"""Expert parallelism on real collectives: 4 gloo ranks train the tiny MoE
(:mod:`moe_ep_model`) 3 SGD steps with its experts split across ``ep=2``
and FSDP over the rest, and match one process training the whole model on
the whole batch; 2 ranks do the same for a Hugging Face Qwen3-MoE, whose
experts get transformers' own dispatch.

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

import pytest
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


# ----------------------------------------------------- a Hugging Face MoE model

HF_RANKS = 2


def _hf_model() -> torch.nn.Module:
    """Qwen3-MoE at toy size, fp32, weights large enough that a wrong
    gradient moves them far beyond the tolerance."""
    import hf_zoo

    torch.manual_seed(0)
    model = hf_zoo.qwen3_moe(device="cpu", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.1)
    return model


def _hf_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _hf_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 64, (HF_RANKS * PER_RANK, SEQ), generator=g) for _ in range(STEPS)]


def _hf_train(model: torch.nn.Module, rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in _hf_batches():
        loss = _hf_loss(model, tokens[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _hf_worker(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    moe_mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("ep_shard", "ep"))
    model = _hf_model()
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh).parallelize(model)
    local = torch.tensor(_hf_train(model, slice(rank * PER_RANK, (rank + 1) * PER_RANK)))
    dist.all_reduce(local)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    experts = model.get_submodule("model.layers.0.mlp.experts")
    return {"losses": (local / world_size).tolist(), "params": params, "local_experts": experts.num_experts}


def test_expert_parallel_training_of_a_hugging_face_moe_matches_one_process() -> None:
    """transformers' experts get transformers' own all-to-all dispatch
    installed (they define no set_expert_parallel_mesh); 2 ranks, ep=2."""
    pytest.importorskip("transformers")
    model = _hf_model()
    losses = _hf_train(model, slice(None))
    results = run_distributed(_hf_worker, HF_RANKS, timeout_s=240.0, collective_timeout_s=60.0)
    for r in results:
        assert r["local_experts"] == 4 // HF_RANKS
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
        for name, p in model.named_parameters():
            torch.testing.assert_close(r["params"][name], p.detach(), atol=1e-4, rtol=1e-4, msg=name)
