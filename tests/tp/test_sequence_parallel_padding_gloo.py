"""Padded batches under sequence parallelism train like one process.

A padded batch hands the model an ``attention_mask`` over the whole
sequence while the residual stream is split along it. Hugging Face builds
its causal-and-padding mask from that mask and the sequence length it reads
off the embeddings, so the length it reads must be the whole one, and the
attention regions must see every key the mask lets through. Llama with its
own TP plan, tp=2 + SP on 2 gloo ranks against one process, left and right
padding in one batch (padded labels ignored), fp32, 3 SGD steps: losses
within 1e-5 relative, parameters within 1e-4.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.testing import run_distributed  # noqa: E402

import hf_zoo  # noqa: E402

WORLD = 2
BATCH, SEQ, STEPS, LR = 3, 8, 3, 0.5


def build() -> nn.Module:
    torch.manual_seed(0)
    return hf_zoo.llama("cpu", torch.float32)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per step: tokens (BATCH, SEQ + 1) and an attention mask (BATCH, SEQ):
    row 0 left-padded by 3, row 1 right-padded by 2, row 2 unpadded."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, hf_zoo.VOCAB, (BATCH, SEQ + 1), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
        mask[0, :3] = 0
        mask[1, -2:] = 0
        out.append((tokens, mask))
    return out


def loss_of(
    model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor | None = None
) -> torch.Tensor:
    """Cross-entropy over the unpadded positions; the model attends as
    ``attention`` says (default: the padding mask)."""
    logits = model(input_ids=tokens[:, :-1], attention_mask=mask if attention is None else attention).logits
    labels = tokens[:, 1:].masked_fill(mask == 0, -100)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
        for n, p in model.named_parameters()
    }


def train(model: nn.Module, after_backward: Any = None) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens, mask in batches():
        opt.zero_grad()
        loss = loss_of(model, tokens, mask)
        loss.backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model)}


@functools.cache
def reference() -> dict[str, Any]:
    return train(build())


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = build()
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
    return train(model, lambda: fsdptx.synchronize_tp_replica_gradients([model], mesh))


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, timeout_s=300, collective_timeout_s=60)


def test_a_padded_batch_under_sequence_parallelism_matches_one_process(runs: list[dict[str, Any]]) -> None:
    ref = reference()
    for rank, got in enumerate(runs):
        torch.testing.assert_close(
            torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0, msg=f"rank {rank} losses"
        )
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=0, atol=1e-4, msg=f"rank {rank} {name}")


def test_the_padding_changes_the_loss(runs: list[dict[str, Any]]) -> None:
    """The mask is not ignored: attending to the padding changes the loss
    over the same positions."""
    model = build()
    tokens, mask = batches()[0]
    with torch.no_grad():
        masked = loss_of(model, tokens, mask).item()
        unmasked = loss_of(model, tokens, mask, attention=torch.ones_like(mask)).item()
    assert abs(masked - unmasked) > 1e-4
    assert runs[0]["losses"][0] == pytest.approx(masked, rel=1e-5)
