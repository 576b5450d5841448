"""A tiny language model whose block stack mixes two block classes, the
way dense-first MoE models do (DeepSeek-V3: dense blocks, then MoE
blocks) or hybrids alternate them: ``stack("DDSS")`` builds
``DenseBlock, DenseBlock, SparseBlock, SparseBlock`` in ``layers``, between
an embedding ``emb`` and a ``head``. It declares no blocks of its own
(``_no_split_modules``), so tests name them with ``blocks=``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DIM", "VOCAB", "DenseBlock", "SparseBlock", "TwoKinds", "stack"]

DIM = 8
VOCAB = 16


class DenseBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mlp(h))


class SparseBlock(DenseBlock):
    """Another class with the same shape: a stand-in for a MoE block."""


class TwoKinds(nn.Module):
    def __init__(self, kinds: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DenseBlock() if k == "D" else SparseBlock() for k in kinds)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def stack(kinds: str, device: str = "cpu", seed: int = 0) -> TwoKinds:
    """Blocks of ``kinds``, one letter each: ``D`` dense, ``S`` sparse."""
    assert set(kinds) <= {"D", "S"}, kinds
    torch.manual_seed(seed)
    with torch.device(device):
        return TwoKinds(kinds)
