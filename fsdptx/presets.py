"""Small reference models that declare their sharding needs the way real ones do.

They back the ``python -m fsdptx plan`` presets, the examples and the
benchmarks. Each is an ordinary ``nn.Module`` with a working forward, so the
same class serves a dry run on the meta device and a real CPU training run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PRESETS", "Decoder", "DecoderConfig", "Titan", "TitanConfig", "build_preset"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x.float() * scale).to(x.dtype) * self.weight.to(x.dtype)


class Attention(nn.Module):
    """Four projections; the mixing is a causal running mean, enough to make
    every projection matter to the loss without a full attention kernel."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.k_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.v_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)
        self.o_proj = nn.Linear(dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.q_proj(x) * self.k_proj(x))
        v = self.v_proj(x)
        steps = torch.arange(1, x.shape[-2] + 1, device=x.device, dtype=v.dtype).unsqueeze(-1)
        out: torch.Tensor = self.o_proj(gate * (v.cumsum(-2) / steps))
        return out


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Sinks(nn.Module):
    """An fp32 parameter holder whose forward ignores its input, like attention
    sinks: exactly the module FSDP2's post-backward hook never fires for."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class Block(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        d, dt = cfg.dim, cfg.dtype
        self.attn_norm = RMSNorm(d, dt)
        self.attn = Attention(d, dt)
        self.mlp_norm = RMSNorm(d, dt)
        self.mlp = MLP(d, cfg.hidden, dt)
        self.sinks = Sinks(d) if cfg.fp32_holders else None
        # A genuinely low-precision sibling among the master weights.
        self.gate = nn.Linear(d, 1, bias=False, dtype=cfg.sibling_dtype) if cfg.sibling_dtype else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.attn_norm(x))
        if self.sinks is not None:
            h = h + self.sinks(x).to(h.dtype)
        if self.gate is not None:
            h = h * torch.sigmoid(self.gate(x.to(self.gate.weight.dtype))).to(h.dtype)
        x = x + h
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


@dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 512
    dim: int = 64
    hidden: int = 128
    layers: int = 4
    dtype: torch.dtype = torch.float32
    fp32_holders: bool = False
    sibling_dtype: torch.dtype | None = None


class Decoder(nn.Module):
    """A Llama-shaped decoder; the class attributes are the declarations the
    default fsdptx pipeline reads (the instance may narrow them)."""

    _no_split_modules = ["Block"]

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim, dtype=cfg.dtype)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.dtype)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False, dtype=cfg.dtype)
        if cfg.fp32_holders:
            self._keep_in_fp32_modules_strict = ["sinks"]
            self._fsdp_shard_across_blocks = ["sinks"]
        self._tp_replica_reductions = {"layers.*.attn_norm": "mean", "layers.*.mlp_norm": "mean", "norm": "mean"}
        # Hugging Face's style names; under sequence parallelism the
        # tensor_parallel transform derives the norms and boundaries itself.
        self._tp_plan = {
            "embed_tokens": "embedding_rowwise",
            "layers.*.attn.q_proj": "colwise",
            "layers.*.attn.k_proj": "colwise",
            "layers.*.attn.v_proj": "colwise",
            "layers.*.attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
            "lm_head": "colwise_rep",
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        out: torch.Tensor = self.lm_head(self.norm(h))
        return out


def llama(layers: int = 16) -> Decoder:
    """A small Llama-like decoder, uniform fp32 storage (master weights)."""
    return Decoder(DecoderConfig(vocab=32000, dim=1024, hidden=2816, layers=layers))


def mixed(layers: int = 16) -> Decoder:
    """Every block mixes an fp32 holder (pinned, cross-block grouped) and a
    bf16 sibling among fp32 master weights: what trips FSDP2's uniform-dtype
    assertion without dtype-aware planning."""
    return Decoder(
        DecoderConfig(
            vocab=32000, dim=1024, hidden=2816, layers=layers, fp32_holders=True, sibling_dtype=torch.bfloat16
        )
    )


@dataclass(frozen=True)
class TitanConfig:
    vocab: int = 512
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden: int = 128
    layers: int = 4
    max_seq_len: int = 256
    rope_theta: float = 10000.0


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the last dim, as interleaved pairs."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class TitanAttention(nn.Module):
    """Grouped-query causal attention with rotary positions. Shapes are read
    from the input and the projections' outputs (heads as ``-1``), so the
    same code runs whole or with its heads split over TP ranks."""

    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.repeats = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        cos, sin = rope[0, :seq, None, :], rope[1, :seq, None, :]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(self.repeats, dim=2), v.repeat_interleave(self.repeats, dim=2)
        mixed = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out: torch.Tensor = self.wo(mixed.transpose(1, 2).reshape(batch, seq, -1))
        return out


class TitanFeedForward(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        return out


class TitanBlock(nn.Module):
    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        # Registered in torchtitan's order: regions first, norms after, so
        # registration order is not the forward order inside a block.
        self.attention = TitanAttention(cfg)
        self.feed_forward = TitanFeedForward(cfg)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=1e-5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        out: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class Titan(nn.Module):
    """A Llama 3 laid out the way torchtitan lays it out: blocks in an
    ``nn.ModuleDict`` (``layers["0"]``), ``tok_embeddings`` / ``norm`` /
    ``output``, rotary tables on the root, and no declaration at all (no
    ``_no_split_modules``, no TP plan): what fsdptx must understand as it is.
    """

    def __init__(self, cfg: TitanConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(cfg) for i in range(cfg.layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-5)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.register_buffer("rope", self._rope_tables(cfg), persistent=False)

    @staticmethod
    def _rope_tables(cfg: TitanConfig) -> torch.Tensor:
        half = cfg.dim // cfg.n_heads // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv)
        return torch.stack((angles.cos(), angles.sin()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = self.config.max_seq_len
        # Token ids (batch, seq), or a later pipeline stage's (batch, seq, dim) activation.
        seq = tokens.shape[1] if tokens.ndim > 1 else tokens.shape[-1]
        if seq > positions:
            raise ValueError(
                f"Titan: a sequence of {seq} tokens is longer than its rotary tables "
                f"({positions} positions); build it with TitanConfig(max_seq_len=...) of at least that length"
            )
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope)
        out: torch.Tensor = self.output(self.norm(h))
        return out


def titan(layers: int = 16, max_seq_len: int = TitanConfig.max_seq_len) -> Titan:
    """torchtitan's Llama 3 layout at a small size (dim 256, as in its debug
    model), with rotary tables for ``max_seq_len`` positions."""
    return Titan(
        TitanConfig(vocab=2048, dim=256, n_heads=16, n_kv_heads=8, hidden=768, layers=layers, max_seq_len=max_seq_len)
    )


PRESETS: dict[str, Callable[[int], nn.Module]] = {"llama": llama, "mixed": mixed, "titan": titan}


def build_preset(name: str, layers: int = 16, *, seq: int | None = None) -> nn.Module:
    """Build a preset by name; ``KeyError`` names the known presets.

    ``seq``, the sequence length the model will be run on, sizes the
    position tables of a preset that has them (``titan``'s rotary tables),
    as torchtitan sets ``max_seq_len`` from the training sequence length;
    ``None`` keeps the preset's own."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    if seq is not None and name == "titan":
        return titan(layers, max_seq_len=seq)
    return PRESETS[name](layers)
