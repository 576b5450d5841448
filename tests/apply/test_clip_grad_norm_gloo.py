"""``fsdptx.clip_grad_norm_`` on real collectives equals torch's
``clip_grad_norm_`` on the whole, unsharded model with the same gradients:
the total norm and every clipped gradient, for ``norm_type`` 2 and ``inf``.

Layouts, on four gloo ranks in one spawn:

- the ``Decoder`` preset on pp=2 x dp=2 (1F1B): each pipeline rank holds
  half the model as FSDP shards over dp;
- the same on pp=2 x tp=2 with sequence parallelism: TP shards, TP-replicated
  norm weights whose gradients stay ``Partial`` until clipping reduces them;
- the tiny MoE (:mod:`moe_ep_model`) with FSDP over dp=4 and its experts on
  another mesh (dp_shard=2 x ep=2), which torch's clipping cannot stack
  with the dense gradients.

Each layout runs one step's backward, clips with ``norm_type=2``, then a
fresh backward clipped with ``inf``; the reference repeats that in one
process on the whole batch. ``max_norm`` is well below the norm, so every
gradient is scaled. Ranks that pass different ``max_norm`` values are
refused on every rank, before any gradient changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
import moe_ep_model
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import run_distributed

WORLD = 4
BATCH, SEQ, MICROBATCHES = 8, 8, 4
DECODER = DecoderConfig(vocab=64, dim=32, hidden=64, layers=4)
NORMS = ((2.0, 0.1), (math.inf, 0.01))  # (norm_type, max_norm)
REL = 1e-5
MOE_PER_RANK = 2


def decoder() -> nn.Module:
    torch.manual_seed(0)
    return Decoder(DECODER)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def decoder_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, DECODER.vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def moe_batch() -> torch.Tensor:
    return torch.randint(0, moe_ep_model.VOCAB, (WORLD * MOE_PER_RANK, SEQ + 1), generator=torch.Generator().manual_seed(2))


def full_grads(parts: Any) -> dict[str, torch.Tensor]:
    grads = {}
    for module in parts:
        for name, p in module.named_parameters():
            assert p.grad is not None, name
            grads[name] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
    return grads


def reference(layout: str) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """One process, the whole batch: per norm type, torch's total norm and
    clipped gradients."""
    model = decoder() if layout != "moe" else moe_ep_model.build()
    out = []
    for norm_type, max_norm in NORMS:
        model.zero_grad()
        if layout == "moe":
            moe_ep_model.loss_of(model, moe_batch()).backward()
        else:
            x, y = decoder_batch()
            loss_fn(model(x), y).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        out.append((total.item(), full_grads([model])))
    return out


def _backward(stages: fsdptx.PipelineStages, mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor) -> None:
    for m in stages:
        m.zero_grad()
    stages.step(inputs=x if stages.is_first else None, target=y if stages.is_last else None)
    if "tp" in (mesh.mesh_dim_names or ()):
        fsdptx.synchronize_tp_replica_gradients(stages, mesh)


def _pipelined(
    names: tuple[str, ...], sp: bool
) -> tuple[list[tuple[float, dict[str, torch.Tensor]]], Callable[[], fsdptx.PipelineStages]]:
    """Clipped results per norm type, and a function that runs one more
    backward on the same stages and returns them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    config = fsdptx.FSDP2Config(
        mp_policy=None,
        sequence_parallel=sp,
        pipeline_parallel=fsdptx.PipelineParallelConfig(schedule="1F1B", microbatches=MICROBATCHES),
    )
    stages = fsdptx.FSDP2Manager(config, mesh).parallelize(decoder(), loss_fn=loss_fn)
    assert isinstance(stages, fsdptx.PipelineStages)
    x, y = decoder_batch()
    if "dp" in names:
        dp = mesh["dp"]
        x, y = x.chunk(dp.size())[dp.get_local_rank()], y.chunk(dp.size())[dp.get_local_rank()]
    out = []
    for norm_type, max_norm in NORMS:
        _backward(stages, mesh, x, y)
        total = fsdptx.clip_grad_norm_(stages, max_norm, norm_type)
        out.append((total.item(), full_grads(stages)))
    def again() -> fsdptx.PipelineStages:
        _backward(stages, mesh, x, y)
        return stages

    return out, again


def _experts_on_another_mesh(rank: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    moe_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    model = moe_ep_model.build()
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh).parallelize(model)
    expert_mesh = model.layers[0].experts.w1.device_mesh
    assert expert_mesh.mesh_dim_names != model.head.weight.device_mesh.mesh_dim_names
    tokens = moe_batch()[rank * MOE_PER_RANK : (rank + 1) * MOE_PER_RANK]
    out = []
    for norm_type, max_norm in NORMS:
        model.zero_grad()
        moe_ep_model.loss_of(model, tokens).backward()
        total = fsdptx.clip_grad_norm_(model, max_norm, norm_type)
        out.append((total.item(), full_grads([model])))
    return out


def _disagreeing_max_norm(rank: int, backward: Callable[[], fsdptx.PipelineStages]) -> dict[str, Any]:
    """Every rank passes its own ``max_norm`` to clip the gradients of a
    fresh ``backward`` (pp=2 x tp=2 with sequence parallelism): each must raise,
    with its gradients as they were, the sequence-parallel norms'
    ``Partial`` ones included (reducing them is a change the refusal must
    come before)."""
    stages = backward()
    grads = [p.grad for m in stages for p in m.parameters()]
    partial = sum(isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements) for g in grads)
    before = [(g.to_local() if isinstance(g, DTensor) else g).clone() for g in grads]
    try:
        fsdptx.clip_grad_norm_(stages, 1.0 + rank)
    except RuntimeError as e:
        error = str(e)
    else:
        error = ""
    after = [p.grad for m in stages for p in m.parameters()]
    unchanged = all(a is g for a, g in zip(after, grads)) and all(
        torch.equal(g.to_local() if isinstance(g, DTensor) else g, b) for g, b in zip(grads, before)
    )
    return {"error": error, "unchanged": unchanged, "partial": partial}


LAYOUTS = ("pp2 x dp2", "pp2 x tp2 SP", "moe")


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    del world_size
    out: dict[str, Any] = {"pp2 x dp2": _pipelined(("pp", "dp"), sp=False)[0]}
    out["pp2 x tp2 SP"], backward = _pipelined(("pp", "tp"), sp=True)
    out["moe"] = _experts_on_another_mesh(rank)
    out["disagreement"] = _disagreeing_max_norm(rank, backward)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=400, collective_timeout_s=60)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", range(len(NORMS)), ids=[f"norm_type={n}" for n, _ in NORMS])
def test_clipping_equals_torch_on_the_whole_model(runs: list[dict[str, Any]], layout: str, which: int) -> None:
    want_norm, want = reference(layout)[which]
    max_norm = NORMS[which][1]
    assert want_norm > 2 * max_norm, "the reference must clip for the comparison to mean anything"
    held: set[str] = set()
    for rank, r in enumerate(runs):
        norm, grads = r[layout][which]
        assert abs(norm - want_norm) <= REL * want_norm, f"rank {rank}: total norm {norm} != {want_norm}"
        held |= grads.keys()
        for name, g in grads.items():
            scale = want[name].abs().max().item()
            worst = (g - want[name]).abs().max().item()
            assert worst <= REL * scale + 1e-12, f"rank {rank} {name}: clipped gradient off by {worst:.3g} (max {scale:.3g})"
    assert held == want.keys()


def test_ranks_disagreeing_about_max_norm_are_refused_on_every_rank(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        assert "ranks disagree about max_norm" in r["disagreement"]["error"], f"rank {rank}: {r['disagreement']}"
        assert "same values on every rank" in r["disagreement"]["error"]
        assert r["disagreement"]["partial"] > 0, f"rank {rank}: no Partial gradient to keep as it was"
        assert r["disagreement"]["unchanged"], f"rank {rank}: a gradient changed before the refusal"
