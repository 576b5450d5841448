"""Sequence parallelism on 4 gloo ranks (dp=2 x tp=2) trains like one process,
whichever way the plan is written.

Three ways people write TP + SP plans, each trained 5 SGD steps in fp32 with
plain, fully checkpointed and 2-micro-batch variants, and with loss
parallelism:

- **torchtitan's way**, an explicit plan of torch styles on a model laid out
  like torchtitan's Llama 3 (blocks in an ``nn.ModuleDict``, no declaration
  of any kind): the embedding already shards the sequence, so fsdptx adds no
  slice of its own; the blocks are found by shape.
- **Hugging Face style with SP declared**: ``rowwise_rep`` embedding and
  ``sequence_parallel`` norms by name.
- **Hugging Face style, SP derived**: the model's plain TP plan; fsdptx
  derives the norms and boundaries.

Why it must match one process in math: each dp rank's loss is the mean over
its own half of the batch and FSDP averages over the 2 dp ranks; the TP
ranks of one dp rank see the same samples; DTensor reduces TP-sharded and
SP-norm gradients itself. Only summation order differs: losses within 1e-5
relative, parameters within 1e-4.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig, Titan, TitanConfig
from fsdptx.testing import run_distributed

from titan_pattern import explicit_plan

WORLD, DP, TP = 4, 2, 2
PER_RANK_BATCH, SEQ, STEPS, LR = 2, 8, 5, 0.5
TITAN = TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=2, max_seq_len=16)
DECODER = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2)
VOCAB = 64


def make(model: str) -> nn.Module:
    torch.manual_seed(0)
    if model == "titan":
        return Titan(TITAN)
    built = Decoder(DECODER)
    if model == "decoder_wrapped":  # blocks wrapped before fsdptx sees them
        for i, block in enumerate(built.layers):
            built.layers[i] = checkpoint_wrapper(block)
    return built


def hf_sp_plan(model: nn.Module) -> dict[str, str]:
    """The decoder's plan with SP declared by name, Hugging Face style."""
    declared = dict(model._tp_plan)  # type: ignore[arg-type]
    norms = {g: "sequence_parallel" for g in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")}
    return {**declared, "embed_tokens": "rowwise_rep", **norms}


def global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, DP * PER_RANK_BATCH, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor, loss_parallel: bool = False) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    labels = tokens[:, 1:].reshape(-1)
    if loss_parallel:  # called inside fsdptx.loss_parallel(), which the backward needs too
        assert isinstance(logits, DTensor), type(logits)
        return F.cross_entropy(logits.flatten(0, 1), labels)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("._checkpoint_wrapped_module", "")] = t.detach().float().clone()
    return out


@functools.cache
def reference(model: str, micro_batches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    m = make(model)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    for step in global_batch():
        opt.zero_grad()
        total = 0.0
        for chunk in step.chunk(micro_batches):
            loss = loss_of(m, chunk) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, full_params(m)


# name -> (model, plan kind, activation checkpointing, micro-batches, loss parallel)
VARIANTS: dict[str, tuple[str, str, bool, int, bool]] = {
    "torchtitan_way": ("titan", "explicit", False, 1, False),
    "torchtitan_way_ac": ("titan", "explicit", True, 1, False),
    "torchtitan_way_micro_batches": ("titan", "explicit", False, 2, False),
    "torchtitan_way_loss_parallel": ("titan", "explicit", False, 1, True),
    "hf_declared_sp": ("decoder", "hf_sp", False, 1, False),
    "hf_declared_sp_ac": ("decoder", "hf_sp", True, 1, False),
    "hf_declared_sp_micro_batches": ("decoder", "hf_sp", False, 2, False),
    "hf_declared_sp_loss_parallel": ("decoder", "hf_sp", False, 1, True),
    "derived": ("decoder", "declared", False, 1, False),
    "derived_ac": ("decoder", "declared", True, 1, False),
    "derived_micro_batches": ("decoder", "declared", False, 2, False),
    "derived_loss_parallel": ("decoder", "declared", False, 1, True),
    "derived_wrapped_blocks": ("decoder_wrapped", "declared", False, 1, False),
}


def _config(model: nn.Module, kind: str, ac: bool, loss_parallel: bool) -> fsdptx.FSDP2Config:
    tp_plan: Any = None
    if kind == "explicit":
        tp_plan = explicit_plan("titan", loss_parallel=loss_parallel)
    elif kind == "hf_sp":
        tp_plan = hf_sp_plan(model)
    return fsdptx.FSDP2Config(
        sequence_parallel=True,
        mp_policy=None,
        tp_plan=tp_plan,
        loss_parallel=loss_parallel,
        activation_checkpointing="full" if ac else False,
    )


def _train(mesh: Any, variant: str) -> dict[str, Any]:
    name, kind, ac, micro_batches, loss_parallel = VARIANTS[variant]
    model = make(name)
    plan = fsdptx.FSDP2Manager(_config(model, kind, ac, loss_parallel), mesh).plan(model)
    fsdptx.FSDP2Manager(_config(model, kind, ac, loss_parallel), mesh).parallelize(model)
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
                if loss_parallel:
                    with fsdptx.loss_parallel():
                        loss = loss_of(model, chunk, True) / micro_batches
                        loss.backward()
                    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                else:
                    loss = loss_of(model, chunk) / micro_batches
                    loss.backward()
            total += loss.detach().float()
        fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()
        dist.all_reduce(total, group=mesh.get_group("dp"))
        losses.append(total.item() / DP)
    assert plan.tensor_parallel is not None
    slices = [s.module for s in plan.tensor_parallel.stream if s.added and s.added.startswith("slice")]
    return {
        "losses": losses,
        "params": full_params(model),
        "blocks": plan.dtype_request.targets if plan.dtype_request else (),
        "slices": slices,
        "assigned": [a.module for a in plan.tensor_parallel.assignments],
        "sums": sorted(k for k, v in plan.reductions.items() if v == "sum"),
    }


def _frozen_norms(mesh: Any) -> dict[str, Any]:
    """One SGD step with frozen norms (block, final): they stay frozen and unchanged."""
    model = make("decoder")
    frozen = ["layers.0.attn_norm.weight", "norm.weight"]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    before = {n: model.get_parameter(n).detach().clone() for n in frozen}
    config = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None)
    fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    loss_of(model, global_batch()[0][:PER_RANK_BATCH]).backward()
    fsdptx.synchronize_tp_replica_gradients([model], mesh)
    opt.step()
    after = {}
    for n in frozen:
        p = model.get_parameter(n)
        after[n] = (p.requires_grad, (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone())
    return {"before": before, "after": after}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {v: _train(mesh, v) for v in VARIANTS}
    out["frozen_norms"] = _frozen_norms(mesh)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=600, collective_timeout_s=60)


def assert_matches_reference(runs: list[dict[str, Any]], variant: str) -> None:
    model, _kind, _ac, micro_batches, _lp = VARIANTS[variant]
    ref_losses, ref_params = reference("decoder" if model == "decoder_wrapped" else model, micro_batches)
    for rank, result in enumerate(runs):
        got = result[variant]
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        assert set(got["params"]) == set(ref_params)
        for name, ref in ref_params.items():
            torch.testing.assert_close(got["params"][name], ref, rtol=0, atol=1e-4, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sequence_parallel_training_matches_one_process(runs: list[dict[str, Any]], variant: str) -> None:
    assert_matches_reference(runs, variant)


def test_a_plan_that_shards_the_sequence_at_the_embedding_gets_no_second_slice(runs: list[dict[str, Any]]) -> None:
    """torchtitan's embedding reduce-scatters onto the sequence; a slice at
    the first block on top would cut it twice (logits for half the tokens)."""
    assert runs[0]["torchtitan_way"]["slices"] == []
    assert runs[0]["derived"]["slices"] == []  # the derived embedding reduce-scatters too


def test_blocks_in_a_module_dict_are_found_without_declarations(runs: list[dict[str, Any]]) -> None:
    assert tuple(runs[0]["torchtitan_way"]["blocks"]) == ("layers.0", "layers.1", "")


def test_wrapped_blocks_are_matched_by_the_declared_plan_and_get_no_sum_marks(runs: list[dict[str, Any]]) -> None:
    """``checkpoint_wrapper``'d blocks are seen through: their projections are
    tensor-parallel like unwrapped ones, none is marked sum and run on the shard."""
    wrapped = runs[0]["derived_wrapped_blocks"]
    assert "layers.0._checkpoint_wrapped_module.attn.q_proj" in wrapped["assigned"]
    assert wrapped["sums"] == []


def test_frozen_norms_stay_frozen_and_unchanged_under_sequence_parallelism(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        frozen = result["frozen_norms"]
        for name, value in frozen["before"].items():
            requires_grad, after = frozen["after"][name]
            assert requires_grad is False, name
            assert torch.equal(after, value), name
