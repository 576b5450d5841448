"""Small models shared by the example-based and property tests.

``TinyDecoder`` declares everything the bare transforms read from a model:
``_no_split_modules`` (its blocks), ``_keep_in_fp32_modules_strict`` (the
attention sinks compute in fp32), ``_fsdp_shard_across_blocks`` (one unit for
every block's sinks) and ``_tp_replica_reductions``. Each block mixes storage
dtypes the way real checkpoints do: bf16 linears, an fp32 "sinks" holder whose
forward ignores its input, and an fp32 router gate. The forward casts at every
boundary, so it runs on CPU with and without a bf16 mixed-precision policy.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "BF16",
    "DIM",
    "FP32",
    "VOCAB",
    "Attention",
    "Block",
    "CastLinear",
    "Gate",
    "Mlp",
    "Sinks",
    "TinyDecoder",
    "make_decoder",
    "master_weights",
    "tokens",
]

DIM = 8
VOCAB = 16
BF16 = torch.bfloat16
FP32 = torch.float32


class CastLinear(nn.Linear):
    """A bias-free linear that casts its input to its weight's dtype, so a bf16
    layer accepts fp32 activations (and vice versa)."""

    def __init__(self, n_in: int, n_out: int, dtype: torch.dtype) -> None:
        super().__init__(n_in, n_out, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Sinks(nn.Module):
    """An fp32 parameter holder whose forward ignores its input and returns
    its weight (the shape of DeepSeek-V4's attention sinks)."""

    def __init__(self, n: int = DIM) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), 0.5, dtype=FP32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class Gate(nn.Module):
    """An fp32 router gate: a per-token sigmoid weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = CastLinear(DIM, 1, FP32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(x))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = CastLinear(DIM, DIM, BF16)
        self.o = CastLinear(DIM, DIM, BF16)
        self.sinks = Sinks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.sinks(x)
        h = torch.tanh(self.q(x).float() + s.float())
        return self.o(h)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = CastLinear(DIM, 2 * DIM, BF16)
        self.down = CastLinear(2 * DIM, DIM, BF16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    """4 bf16 params (attn.q, attn.o, mlp.up, mlp.down), 1 fp32 sinks param,
    1 fp32 gate param."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.mlp = Mlp()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float() + self.attn(x).float()
        h = h + self.gate(h).float() * self.mlp(h).float()
        return h.to(x.dtype)


class TinyDecoder(nn.Module):
    """Embedding, ``n_layers`` blocks in ``layers``, final norm and head (all
    bf16, so the root unit is dtype-uniform)."""

    _no_split_modules = ["Block"]
    _keep_in_fp32_modules_strict = ["sinks"]
    _fsdp_shard_across_blocks = ["attn.sinks"]
    _tp_replica_reductions = {"layers.*.gate.proj": "sum", "norm": "mean"}

    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, dtype=BF16)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM, dtype=BF16)
        self.head = CastLinear(DIM, VOCAB, BF16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h.to(self.norm.weight.dtype))
        return self.head(h)


def make_decoder(n_layers: int = 2, *, device: str | torch.device = "cpu", seed: int = 0) -> TinyDecoder:
    """A deterministic ``TinyDecoder`` on ``device`` (``"meta"`` works)."""
    torch.manual_seed(seed)
    with torch.device(device):
        return TinyDecoder(n_layers)


def tokens(batch: int = 2, seq: int = 3) -> torch.Tensor:
    """A deterministic batch of token ids for ``TinyDecoder``."""
    return torch.arange(batch * seq).reshape(batch, seq) % VOCAB


def container(**children: nn.Module) -> nn.Module:
    """A tensor-less module with the given children, registered in argument order."""
    m = nn.Module()
    for name, child in children.items():
        m.add_module(name, child)
    return m


def module_tree(paths: list[list[str]]) -> nn.Module:
    """Tensor-less modules at the given paths (each a list of child names from
    the root), sharing the prefixes paths have in common: a module tree whose
    shape alone is under test, as in how globs find modules."""
    root = nn.Module()
    for path in paths:
        here = root
        for name in path:
            if name not in here._modules:
                here.add_module(name, nn.Module())
            child = here._modules[name]
            assert child is not None
            here = child
    return root


def master_weights(module: nn.Module, *suffixes: str) -> nn.Module:
    """Record bf16 compute (``_hf_compute_dtype``, as a checkpoint load does)
    on ``module``'s fp32 parameters whose names end with one of
    ``suffixes``: fp32 master weights of bf16 compute. In a bf16-bulk model
    an fp32 parameter without that record is intrinsically fp32 and
    computes in fp32; tests of three (storage, compute) groups need the
    third, fp32->bf16, group this way. Returns ``module``."""
    for name, p in module.named_parameters():
        if p.dtype == FP32 and name.endswith(suffixes):
            p._hf_compute_dtype = BF16  # type: ignore[attr-defined]
    return module
