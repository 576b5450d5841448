"""Hugging Face models whose own TP plans leave block regions alone train
like one process under sequence parallelism, on 4 gloo ranks (dp=2 x tp=2).

- DeepSeek-V3: the plan covers the MLPs (a dense one, an MoE's shared
  expert and routed experts), not the MLA attention, whose low-rank
  projections and rotary slices then run on the whole sequence; the MoE
  block, whose router the plan leaves alone, too, its experts split over TP
  inside it.
- Jamba, a hybrid: the plan names only the experts (split over TP), so
  every region (Mamba mixer, attention, MLP, MoE) runs on the whole
  sequence while the norms and the residual stream stay on the shard.
- GPT-OSS: the plan splits only the embedding and the head, so each
  block's attention (its per-head ``sinks`` held directly on it, sliding
  and full layers alternating) and its MoE (router and experts, none
  split) run on the whole sequence; their parameters stay replicas on
  the TP ranks, each of which computes their gradients from the whole
  sequence.

fp32, mixed precision off, 5 SGD steps; losses within 1e-5 relative,
parameters within 1e-4 of one process (summation order only). The
sequence is longer than GPT-OSS's 16-token sliding window, so its sliding
layers mask keys a full layer would attend to.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.testing import run_distributed  # noqa: E402

import hf_zoo  # noqa: E402

WORLD, DP, TP = 4, 2, 2
PER_RANK_BATCH, SEQ, STEPS, LR = 2, 24, 5, 0.5
MODELS = ("deepseek_v3", "jamba", "gpt_oss")


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return getattr(hf_zoo, name)("cpu", torch.float32)


def global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, hf_zoo.VOCAB, (STEPS, DP * PER_RANK_BATCH, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for n, p in model.named_parameters()
    }


@functools.cache
def reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in global_batch():
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, full_params(model)


def _train(mesh: Any, name: str) -> dict[str, Any]:
    model = build(name)
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank = mesh.get_coordinate()[0]
    losses = []
    for step in global_batch():
        opt.zero_grad()
        loss = loss_of(model, step[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH])
        loss.backward()
        fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        losses.append(total.item() / DP)
    return {"losses": losses, "params": full_params(model)}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    return {name: _train(mesh, name) for name in MODELS}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=600, collective_timeout_s=60)


@pytest.mark.parametrize("name", MODELS)
def test_hugging_face_model_with_its_own_plan_under_sequence_parallelism_matches_one_process(
    runs: list[dict[str, Any]], name: str
) -> None:
    ref_losses, ref_params = reference(name)
    for rank, result in enumerate(runs):
        got = result[name]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        for param, ref in ref_params.items():
            torch.testing.assert_close(got["params"][param], ref, rtol=0, atol=1e-4, msg=f"rank {rank} {param}")
