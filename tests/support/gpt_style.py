"""A GPT-style decoder with the block that Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4)
size their activations for, to check the dry run's traced activations
against their closed form.

Per block: pre-LayerNorm self-attention (separate query, key and value
projections ``wq``/``wk``/``wv``, so the dry run finds the attention for ring
attention's K/V buffers; output projection ``wo``; a dropout on the
residual branch) and a pre-LayerNorm MLP (``h -> 4h``, GELU, ``4h -> h``;
a dropout on the residual branch). Attention is either ``"sdpa"`` (torch's
fused kernel: it keeps no score matrix, the attention torch's ring attention
replaces under context parallelism) or ``"explicit"`` (``softmax(QK^T)``, a
dropout on the probabilities and their product with V, each result kept
for backward as the paper counts them). The causal mask is added to the
scores from one tensor shared by all blocks, so it is no per-layer term.

Hugging Face GPT-2 is not used because its fused ``c_attn`` projection has
no separate key and value ``nn.Linear`` for the dry run to size ring
attention's buffers from: a ``cp`` axis > 1 refuses it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["Attention", "AttentionKind", "GPT", "GPTBlock", "Mlp", "build_gpt"]

AttentionKind = Literal["sdpa", "explicit"]


class Attention(nn.Module):
    """Multi-head causal self-attention over ``heads`` heads of ``hidden // heads``."""

    def __init__(self, hidden: int, heads: int, kind: AttentionKind, dropout: float) -> None:
        super().__init__()
        if kind == "sdpa" and dropout:
            # On CPU a non-zero dropout sends SDPA to its fp32 math path, and ring attention has no dropout.
            raise ValueError("sdpa attention is built without attention dropout")
        self.heads, self.kind, self.dropout = heads, kind, dropout
        self.wq = nn.Linear(hidden, hidden)
        self.wk = nn.Linear(hidden, hidden)
        self.wv = nn.Linear(hidden, hidden)
        self.wo = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (w(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) * (h // self.heads) ** -0.5 + mask
            probs = F.dropout(F.softmax(scores, dim=-1), self.dropout, self.training)
            out = probs @ v
        projected: torch.Tensor = self.wo(out.transpose(1, 2).reshape(b, s, h))
        return projected


class Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))
        return out


class GPTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int, kind: AttentionKind, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, kind, dropout if kind == "explicit" else 0.0)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = Mlp(hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln_1(x), mask), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln_2(x)), self.dropout, self.training)


class GPT(nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, a final
    LayerNorm and an untied head; returns the logits."""

    _no_split_modules = ["GPTBlock"]

    def __init__(
        self,
        *,
        layers: int,
        hidden: int,
        heads: int,
        vocab: int,
        max_seq: int,
        attention: AttentionKind,
        dropout: float,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_seq, hidden)
        self.dropout = dropout
        self.blocks = nn.ModuleList(GPTBlock(hidden, heads, attention, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[-1]
        x = F.dropout(self.wte(tokens) + self.wpe(torch.arange(s, device=tokens.device)), self.dropout, self.training)
        mask = torch.full((s, s), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def build_gpt(
    layers: int,
    *,
    hidden: int = 256,
    heads: int = 4,
    vocab: int = 512,
    max_seq: int = 2048,
    attention: AttentionKind = "sdpa",
    dropout: float = 0.0,
    device: str | torch.device = "meta",
) -> GPT:
    """A :class:`GPT` in fp32 storage on ``device`` (``"meta"`` to plan)."""
    with torch.device(device):
        return GPT(
            layers=layers,
            hidden=hidden,
            heads=heads,
            vocab=vocab,
            max_seq=max_seq,
            attention=attention,
            dropout=dropout,
        )
