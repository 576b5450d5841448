"""Hugging Face MoE models whose experts are split by tensor parallelism
train like one process, on 4 gloo ranks (dp=2 x tp=2), with their own
declared TP plans.

Each expert's gate and up projections are split per half and its down
projection by input column (``moe_tp_experts`` with ``packed_colwise`` /
``rowwise``); the experts' partial outputs are all-reduced, and so are the
gradients of their inputs, so the routers (TP replicas) see full gradients.

- Qwen3-MoE and Mixtral, without and with sequence parallelism (the MoE
  block then runs on the whole sequence: its router is outside the TP
  styles; the experts inside it stay split);
- DeepSeek-V3: MLA attention left whole, a dense MLP and the shared expert
  TP-split beside the split routed experts (and its fp32-declared router);
- the peer: Qwen3-MoE and Mixtral parallelized by hand in torchtitan's MoE
  pattern (``titan_pattern``) train like one process too, and like fsdptx
  with sequence parallelism step for step.

fp32, mixed precision off, 3 SGD steps; losses within 1e-5 relative,
parameters within 1e-4 of one process (summation order only). One launch
runs every scenario, to pay the process start-up once.
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
from torch.distributed.tensor import DTensor, Replicate

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.testing import run_distributed  # noqa: E402

import hf_zoo  # noqa: E402
from titan_pattern import parallelize_by_hand  # noqa: E402

WORLD, DP, TP = 4, 2, 2
PER_RANK_BATCH, SEQ, STEPS, LR = 2, 8, 3, 0.5
SCENARIOS = (("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False), ("mixtral", True), ("deepseek_v3", False))
BY_HAND = {"qwen3_moe": "hf_qwen3_moe", "mixtral": "hf_mixtral"}  # model -> titan_pattern layout


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = getattr(hf_zoo, name)("cpu", torch.float32)
    return model


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


def _steps(model: nn.Module, mesh: Any, sync: bool) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank = mesh.get_coordinate()[0]
    losses = []
    for step in global_batch():
        opt.zero_grad()
        loss = loss_of(model, step[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH])
        loss.backward()
        if sync:
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        losses.append(total.item() / DP)
    return losses


def _train_by_hand(mesh: Any, name: str) -> dict[str, Any]:
    model = parallelize_by_hand(build(name), BY_HAND[name], mesh)
    return {"losses": _steps(model, mesh, sync=False), "params": full_params(model)}


def _train(mesh: Any, name: str, sp: bool) -> dict[str, Any]:
    model = build(name)
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=sp, mp_policy=None), mesh).parallelize(model)
    split = sorted(
        n for n, p in model.named_parameters() if ".experts." in n and isinstance(p, DTensor) and p.to_local().numel() * DP * TP == p.numel()
    )
    gate_up = model.get_submodule(f"model.layers.{hf_zoo.LAYERS - 1}.mlp.experts").gate_up_proj
    tp_local = gate_up.redistribute(placements=[Replicate(), gate_up.placements[1]]).to_local().detach().clone()
    losses = _steps(model, mesh, sync=True)
    return {"losses": losses, "params": full_params(model), "split": split, "gate_up": tp_local}


def _worker(rank: int, world_size: int) -> dict[Any, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    runs: dict[Any, Any] = {(name, sp): _train(mesh, name, sp) for name, sp in SCENARIOS}
    runs.update({(name, "by_hand"): _train_by_hand(mesh, name) for name in BY_HAND})
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict[Any, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=900, collective_timeout_s=60)


def test_each_tp_rank_keeps_its_rows_of_both_the_gate_and_the_up_half(runs: list[dict[Any, Any]]) -> None:
    """A plain Shard(1) of the packed gate|up weight would hand TP rank 0
    the whole gate and rank 1 the whole up projection, and the kernel's
    chunk(2) would pair gate rows with gate rows."""
    full = build("qwen3_moe").get_submodule(f"model.layers.{hf_zoo.LAYERS - 1}.mlp.experts").gate_up_proj.detach()
    half = full.shape[1] // 2
    for rank, result in enumerate(runs):
        tp_rank = rank % TP
        rows = slice(tp_rank * half // TP, (tp_rank + 1) * half // TP)
        expected = torch.cat([full[:, :half][:, rows], full[:, half:][:, rows]], dim=1)
        torch.testing.assert_close(result[("qwen3_moe", False)]["gate_up"], expected, rtol=0, atol=0)


@pytest.mark.parametrize(("name", "sp"), SCENARIOS, ids=[f"{n}-{'sp' if s else 'tp'}" for n, s in SCENARIOS])
def test_moe_model_with_tp_split_experts_matches_one_process(
    runs: list[dict[Any, Any]], name: str, sp: bool
) -> None:
    ref_losses, ref_params = reference(name)
    expert_weights = sorted(n for n in ref_params if ".experts." in n)
    for rank, result in enumerate(runs):
        got = result[(name, sp)]
        assert got["split"] == expert_weights, f"rank {rank}: expert weights not split over dp x tp"
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        for param, ref in ref_params.items():
            torch.testing.assert_close(got["params"][param], ref, rtol=0, atol=1e-4, msg=f"rank {rank} {param}")


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_torchtitans_moe_pattern_by_hand_matches_one_process_and_fsdptx_with_sp(
    runs: list[dict[Any, Any]], name: str
) -> None:
    """The peer the collectives are compared with computes the same thing:
    its losses and parameters match one process, and its losses match
    fsdptx's with sequence parallelism step for step."""
    ref_losses, ref_params = reference(name)
    for rank, result in enumerate(runs):
        hand, ours = result[(name, "by_hand")], result[(name, True)]
        torch.testing.assert_close(
            torch.tensor(hand["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(hand["losses"]), rtol=1e-5, atol=0, msg=f"rank {rank} vs by hand"
        )
        for param, ref in ref_params.items():
            torch.testing.assert_close(hand["params"][param], ref, rtol=0, atol=1e-4, msg=f"rank {rank} {param}")
