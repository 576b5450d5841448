"""Real two-rank FSDP2 training (gloo, CPU) of a model that mixes storage dtypes.

The model stores fp32 linears beside fp64 parameters in the same block and at
the root, with mixed precision disabled. Sharded as one unit per block, FSDP2
refuses it ("FSDP expects uniform original parameter dtype"); the fsdptx
pipeline splits it into storage-uniform units plus one cross-block unit for
the per-block fp32 holders. The test shows that this sharding is not just
accepted but *numerically transparent*: three SGD steps on two ranks give the
same losses and the same final parameters as the unsharded model trained in
one process on both ranks' data.

Why the comparison is exact in math: each rank's loss is the mean over its
own equal-sized half of the batch, and FSDP2 averages gradients over the 2
data-parallel ranks, so the gradient each rank applies is the gradient of the
mean loss over the whole batch, which is what the reference computes. Only
floating-point summation order differs, hence the 1e-5 tolerance; every
trained parameter is fp32 or fp64 because bf16 rounding would exceed it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.testing import run_distributed

WORLD_SIZE = 2
DIM = 16
VOCAB = 32
SEQ_LEN = 8
PER_RANK_BATCH = 2
STEPS = 3
LR = 0.5  # large enough that a wrong gradient scale (sum vs mean) moves params far beyond 1e-5
ATOL = 1e-5
RTOL = 1e-5


class SinkHolder(nn.Module):
    """A tiny per-block fp32 vector whose forward ignores its input, like
    attention sinks: the kind of holder ``_fsdp_shard_across_blocks`` gathers
    into one FSDP unit spanning all blocks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class Fp64RMSNorm(nn.Module):
    """An RMS norm stored and computed in fp64 inside an fp32 model: the
    minority storage dtype that makes a plain per-block FSDP2 unit invalid.
    It casts its own input and output, so the forward runs on CPU with mixed
    precision disabled."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float64) + 0.1 * torch.randn(dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x64 = x.double()
        normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * self.weight).to(x.dtype)


class Block(nn.Module):
    """fp32 linears, an fp64 norm and an fp64 gating linear, and an fp32 sink
    holder, all under one block module."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = Fp64RMSNorm(dim)
        self.attn = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim, dtype=torch.float64)
        self.mlp = nn.Linear(dim, dim)
        self.sinks = SinkHolder(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + torch.tanh(self.attn(self.norm(x)) + self.sinks(x))
        g = torch.sigmoid(self.gate(h.double())).float()
        return h + g * self.mlp(h)


class TinyDecoder(nn.Module):
    """Embedding, two blocks, an fp64 final norm and an fp32 head. Declares its
    blocks and cross-block holders the way a Hugging Face model would, so the
    fsdptx transforms run bare."""

    _no_split_modules = ["Block"]
    _fsdp_shard_across_blocks = ["sinks"]
    _tp_replica_reductions = {"final_norm": "mean"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(2))
        self.final_norm = Fp64RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.final_norm(h))


def make_model() -> TinyDecoder:
    """The same initial weights in every process (the seed is the only source
    of randomness), so sharded ranks and the reference start identical."""
    torch.manual_seed(0)
    return TinyDecoder()


def make_tokens() -> torch.Tensor:
    """The global batch, ``WORLD_SIZE * PER_RANK_BATCH`` rows; rank r trains on
    rows ``[r * PER_RANK_BATCH, (r + 1) * PER_RANK_BATCH)``."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (WORLD_SIZE * PER_RANK_BATCH, SEQ_LEN + 1), generator=g)


def mean_next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of ``tokens``: a mean (not a
    sum) so that the average over equal halves equals the whole-batch value."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model: nn.Module, tokens: torch.Tensor) -> list[float]:
    """``STEPS`` plain SGD steps on one fixed batch; returns the loss of each
    step (before its update). Plain SGD keeps the update linear in the
    gradient, so a summation-order difference stays at rounding level."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = mean_next_token_loss(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def pipeline_plan(model: nn.Module) -> fsdptx.Plan:
    """The plan under test: the three transforms, mixed precision disabled."""
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    return fsdptx.plan(model, pipeline, mp_policy=None)


def _train_sharded_worker(rank: int, world_size: int) -> dict[str, Any]:
    """One rank: confirm plain FSDP2 rejects the model, then shard it with the
    fsdptx plan, train, and gather the full parameters."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    tokens = make_tokens()[rank * PER_RANK_BATCH : (rank + 1) * PER_RANK_BATCH]

    # The premise: without fsdptx, one FSDP2 unit per block fails at the first
    # forward (lazy init, before any collective, so every rank fails alike).
    plain = make_model()
    for block in plain.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    try:
        plain(tokens[:, :-1])
    except AssertionError as e:
        plain_error = str(e)
    else:
        plain_error = ""
    del plain

    model = make_model()
    fsdptx.apply_plan(pipeline_plan(model), model, mesh)
    losses = train(model, tokens)

    # full_tensor() is a collective: every rank gathers every parameter, in
    # the same (registration) order.
    full: dict[str, torch.Tensor] = {}
    kinds: dict[str, tuple[bool, torch.dtype]] = {}
    for name, param in model.named_parameters():
        is_dtensor = isinstance(param, DTensor)
        kinds[name] = (is_dtensor, param.dtype)
        full[name] = (param.full_tensor() if is_dtensor else param).detach().clone()
    return {
        "losses": losses,
        "params": full,
        "kinds": kinds,
        "plain_error": plain_error,
    }


def _train_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsharded model, one process, on the concatenated global batch."""
    model = make_model()
    losses = train(model, make_tokens())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dtype_sharded_training_on_two_gloo_ranks_matches_single_process_reference() -> None:
    # The plan really splits the model by storage dtype and spans the blocks'
    # holders with one unit; otherwise this test would not exercise fsdptx.
    layout = [(u.kind, u.modules, u.storage_dtype) for u in pipeline_plan(make_model()).units]
    assert ("cross-block", ("layers.0.sinks", "layers.1.sinks"), torch.float32) in layout
    assert ("block", ("layers.0",), torch.float32) in layout
    assert ("root", ("",), torch.float32) in layout
    assert {d for _k, _m, d in layout} == {torch.float32, torch.float64}

    results = run_distributed(_train_sharded_worker, WORLD_SIZE, timeout_s=300.0, collective_timeout_s=30.0)
    ref_losses, ref_params = _train_reference()

    for rank, r in enumerate(results):
        assert "uniform original parameter dtype" in r["plain_error"], (
            f"rank {rank}: plain per-block fully_shard was expected to reject the mixed-dtype "
            f"model; got {r['plain_error']!r}"
        )
        # Every parameter is sharded (a DTensor) and keeps its storage dtype.
        for name, (is_dtensor, dtype) in r["kinds"].items():
            assert is_dtensor, f"rank {rank}: {name} was not sharded"
            assert dtype == ref_params[name].dtype, f"rank {rank}: {name} is {dtype}"

    # Each rank's loss is the mean over its half; the average over ranks is
    # the reference's mean over the whole batch.
    losses = [sum(r["losses"][s] for r in results) / WORLD_SIZE for s in range(STEPS)]
    torch.testing.assert_close(
        torch.tensor(losses, dtype=torch.float64),
        torch.tensor(ref_losses, dtype=torch.float64),
        atol=ATOL,
        rtol=RTOL,
    )
    # Training did move the loss, so matching parameters is not trivial.
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3

    for rank, r in enumerate(results):
        assert r["params"].keys() == ref_params.keys()
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                r["params"][name], ref, atol=ATOL, rtol=RTOL, msg=lambda m, n=name, k=rank: f"rank {k}, {n}: {m}"
            )
