"""FSDP2Manager on 4 gloo ranks (dp=2 x tp=2, sequence parallel) trains like
one process does.

The model is the ``llama`` preset at toy size with one extra per-block fp32
holder (``sinks``) outside the TP plan: under sequence parallelism it sees
only its rank's sequence shard, so its gradient on each TP rank is a partial
sum, and the ``tensor_parallel`` transform gives it a ``sum`` TP-replica mark
(nothing in the model declares it). Each variant trains 5 SGD
steps and is compared with the unsharded model trained in this process on
the global batch:

- why it should match exactly in math: each data-parallel rank's loss is
  the mean over its own equal share of the batch, FSDP averages gradients
  over the 2 dp ranks, TP ranks of one dp rank see the same samples, and
  DTensor reduces TP-sharded and sequence-parallel norm gradients itself;
  ``synchronize_tp_replica_gradients`` sums the holders' partial gradients.
  Only summation order differs, hence the 1e-5 / 1e-4 tolerances.
- the control without the sync must drift: the holders on the two TP ranks
  of one dp rank end up different, so the test can fail.

All variants run inside one spawn of 4 processes (a spawn costs seconds).
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

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import run_distributed

WORLD = 4
DP = 2
TP = 2
PER_RANK_BATCH = 2
SEQ = 8
STEPS = 5
LR = 0.5
CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2, fp32_holders=True)


def make_model() -> Decoder:
    """Same weights in every process; the holders start non-zero so that a
    wrong reduction shows in the first step."""
    torch.manual_seed(0)
    model = Decoder(CFG)
    with torch.no_grad():
        for block in model.layers:
            block.sinks.weight.normal_(0, 0.1)
    return model


def global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab, (STEPS, DP * PER_RANK_BATCH, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, CFG.vocab), tokens[:, 1:].reshape(-1))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().clone()
    return out


def reference(micro_batches: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in global_batch():
        opt.zero_grad()
        total = 0.0
        for chunk in step.chunk(micro_batches):
            loss = loss_of(model, chunk) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, full_params(model)


def _train(rank: int, mesh: Any, config: fsdptx.FSDP2Config, *, sync: bool, micro_batches: int) -> dict[str, Any]:
    model = make_model()
    fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank = mesh.get_coordinate()[0]
    losses = []
    for step in global_batch():
        local = step[dp_rank * PER_RANK_BATCH : (dp_rank + 1) * PER_RANK_BATCH]
        opt.zero_grad()
        total = torch.zeros(())
        chunks = local.chunk(micro_batches)
        for i, chunk in enumerate(chunks):
            with fsdptx.gradient_sync_context(model, is_optimizer_step=i == len(chunks) - 1):
                loss = loss_of(model, chunk) / micro_batches
                loss.backward()
            total += loss.detach().float()
        if sync:
            fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        losses.append(total.item() / DP)
    sinks = torch.stack([b.sinks.weight.full_tensor().detach() for b in model.layers])
    return {"losses": losses, "params": full_params(model), "sinks": sinks}


FP32 = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None)
VARIANTS: dict[str, tuple[fsdptx.FSDP2Config, bool, int]] = {
    "sp": (FP32, True, 1),
    "sp_ac_full": (fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, activation_checkpointing="full"), True, 1),
    "sp_ac_selective": (
        fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, activation_checkpointing="selective"),
        True,
        1,
    ),
    "sp_two_micro_batches": (FP32, True, 2),
    "sp_without_sync": (FP32, False, 1),
    "sp_bf16": (fsdptx.FSDP2Config(sequence_parallel=True), True, 1),
}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    return {
        name: _train(rank, mesh, config, sync=sync, micro_batches=micro)
        for name, (config, sync, micro) in VARIANTS.items()
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_worker, WORLD, timeout_s=300, collective_timeout_s=60)


@functools.cache
def _reference(micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return reference(micro_batches)


def assert_matches_reference(runs: list[dict[str, dict[str, Any]]], variant: str, micro_batches: int = 1) -> None:
    ref_losses, ref_params = _reference(micro_batches)
    for rank, result in enumerate(runs):
        got = result[variant]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        for name, ref in ref_params.items():
            torch.testing.assert_close(got["params"][name], ref, rtol=0, atol=1e-4, msg=f"rank {rank} {name}")


def test_sequence_parallel_plan_marks_the_holders_on_the_sequence_shard_sum() -> None:
    with torch.device("meta"):
        model = make_model()
    p = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True))
    assert {k: v for k, v in p.reductions.items() if "sinks" in k} == {
        f"layers.{i}.sinks.weight": "sum" for i in range(CFG.layers)
    }


def test_dp2_tp2_sequence_parallel_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    assert_matches_reference(runs, "sp")


def test_full_activation_checkpointing_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    assert_matches_reference(runs, "sp_ac_full")


def test_selective_activation_checkpointing_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    assert_matches_reference(runs, "sp_ac_selective")


def test_two_micro_batches_under_gradient_sync_context_match_single_process(
    runs: list[dict[str, dict[str, Any]]],
) -> None:
    assert_matches_reference(runs, "sp_two_micro_batches", micro_batches=2)


def test_without_tp_replica_sync_the_sequence_shard_holders_drift_apart(
    runs: list[dict[str, dict[str, Any]]],
) -> None:
    """Ranks 0 and 1 are the two TP ranks of dp rank 0: their holders, which
    saw different sequence halves, end different, and neither matches the
    reference; the synced run keeps them equal."""
    drift = (runs[0]["sp_without_sync"]["sinks"] - runs[1]["sp_without_sync"]["sinks"]).abs().max().item()
    assert drift > 1e-3
    synced = (runs[0]["sp"]["sinks"] - runs[1]["sp"]["sinks"]).abs().max().item()
    assert synced < 1e-6
    _, ref_params = _reference(1)
    ref_sinks = torch.stack([ref_params[f"layers.{i}.sinks.weight"] for i in range(CFG.layers)])
    assert (runs[0]["sp_without_sync"]["sinks"] - ref_sinks).abs().max().item() > 1e-3


def test_bf16_compute_stays_finite_identical_across_tp_ranks_and_near_fp32(
    runs: list[dict[str, dict[str, Any]]],
) -> None:
    """bf16 compute (the default policy) with fp32 master weights: every
    loss finite, TP peers bit-identical, losses within 2% of the fp32
    reference (bf16 keeps 8 bits of mantissa; 5 steps at this size stay
    well inside that)."""
    ref_losses, _ = _reference(1)
    for rank, result in enumerate(runs):
        losses = torch.tensor(result["sp_bf16"]["losses"])
        assert torch.isfinite(losses).all()
        torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=2e-2, atol=0, msg=f"rank {rank}")
    for a, b in ((0, 1), (2, 3)):
        for name, value in runs[a]["sp_bf16"]["params"].items():
            assert torch.equal(value, runs[b]["sp_bf16"]["params"][name]), name
