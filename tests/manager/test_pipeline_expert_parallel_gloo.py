"""Expert parallelism inside pipeline stages, on real collectives: four
gloo ranks train the tiny MoE (:mod:`moe_ep_model`, two MoE blocks) three
SGD steps in fp32 on pp=2 x dp=2, each stage's experts split by ep=2 over
the MoE mesh pp=2 x dp_shard=1 x ep=2, and match one process training the
whole model on the whole batch.

Through ``FSDP2Manager(config, mesh, moe_mesh=...).parallelize(model,
loss_fn=...)``: stage 0 holds the embedding and ``layers.0``, stage 1
``layers.1`` and the head; within a stage the two dp ranks are the two ep
ranks, each holding half of the stage's experts and sending tokens to the
other's with an all-to-all.

Why parity is exact up to summation order: the schedule divides each
micro-batch's gradient by the micro-batch count, so a stage's gradient is
that of the mean loss over its rank's half of the batch; dense gradients
are averaged over dp; an expert's gradient collects, through the
all-to-all's backward, the contributions of every token routed to it from
both ep ranks, and is then divided by ep x dp_shard = 2, the same mean. The
learning rate is large, so a wrong scale (a sum for a mean, experts'
gradients not divided) moves the weights far beyond the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.testing import run_distributed
from moe_ep_model import EXPERTS, LAYERS, VOCAB, GroupedExperts, build

WORLD = 4
EP = 2
STEPS = 3
LR = 0.5
BATCH, SEQ, MICROBATCHES = 8, 8, 2
REL = 1e-5


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    return tokens[:, :-1], tokens[:, 1:]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: losses, initial and final parameters."""
    model = build()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    del rank
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp"))
    moe_mesh = init_device_mesh("cpu", (2, 1, EP), mesh_dim_names=("pp", "dp_shard", "ep"))
    config = fsdptx.FSDP2Config(
        mp_policy=None, pipeline_parallel=fsdptx.PipelineParallelConfig(microbatches=MICROBATCHES)
    )
    stages = fsdptx.FSDP2Manager(config, mesh, moe_mesh=moe_mesh).parallelize(build(), loss_fn=loss_fn)
    assert isinstance(stages, fsdptx.PipelineStages)
    experts = {
        f: (m.w1.to_local().shape[0], m.ep_mesh.size() if m.ep_mesh is not None else None)
        for module in stages
        for f, m in module.named_modules()
        if isinstance(m, GroupedExperts)
    }
    opt = torch.optim.SGD([p for m in stages for p in m.parameters()], lr=LR)
    dp = mesh["dp"]
    x, y = (t.chunk(dp.size())[dp.get_local_rank()] for t in batch())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        got = stages.step(inputs=x if stages.is_first else None, target=y if stages.is_last else None)
        opt.step()
        if got is not None:
            losses.append(torch.stack(got).mean())
    out: dict[str, Any] = {"indices": stages.indices, "experts": experts, "losses": None}
    if losses:  # the last stage's dp group: the mean over its halves is the whole batch's loss
        mean = torch.stack(losses).detach()
        dist.all_reduce(mean, group=dp.get_group())
        out["losses"] = (mean / dp.size()).tolist()
    out["params"] = {n: full(p) for m in stages for n, p in m.named_parameters()}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=120.0, collective_timeout_s=30.0)


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item()
    worst = (actual - expected).abs().max().item()
    assert worst <= REL * scale, f"{what}: max |difference| {worst:.3g} exceeds {REL} x max |value| {scale:.3g}"


def test_each_stage_splits_its_own_blocks_experts_over_the_ep_ranks(runs: list[dict[str, Any]]) -> None:
    assert [r["indices"] for r in runs] == [(0,), (0,), (1,), (1,)]
    assert LAYERS == 2
    for rank, r in enumerate(runs):
        layer = r["indices"][0]
        assert r["experts"] == {f"layers.{layer}.experts": (EXPERTS // EP, EP)}, f"rank {rank}"


def test_pipelined_expert_parallel_training_matches_one_process(runs: list[dict[str, Any]]) -> None:
    want_losses, initial, want = reference()
    last = [r for r in runs if r["losses"] is not None]
    assert len(last) == 2, "the last stage runs on the two ranks of pp coordinate 1"
    for r in last:
        _assert_rel(torch.tensor(r["losses"]), torch.tensor(want_losses), "losses")
    held = {n for r in runs for n in r["params"]}
    assert held == want.keys(), f"the stages hold {sorted(held ^ want.keys())} unlike the whole model"
    for rank, r in enumerate(runs):
        for name, value in r["params"].items():
            _assert_rel(value, want[name], f"rank {rank} {name}")
    # the steps move every weight far beyond the tolerance: the comparison has teeth
    still = [n for n in want if (want[n] - initial[n]).abs().max() <= 100 * REL * want[n].abs().max()]
    assert not still, f"{still} did not move"
