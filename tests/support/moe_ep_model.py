"""A tiny MoE language model that does its own expert-parallel token dispatch.

Its experts follow the grouped layout torchtitan's MoE models use: each
weight stacks every expert on dim 0 (``w1: [experts, dim, hidden]``,
``w2: [experts, hidden, dim]``). Told its ``ep`` mesh
(``set_expert_parallel_mesh``), the experts module holds only its own
experts (a ``Shard(0)`` DTensor after ``apply_plan``) and its forward sends
each (token, expert) pair to the ep rank holding that expert with an
all-to-all, runs the local experts, and sends the results back. Untold, it
runs every expert itself: the single-process reference the EP runs are
compared with.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

VOCAB = 32
DIM = 16
HIDDEN = 24
EXPERTS = 4
TOP_K = 2
LAYERS = 2


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` whose backward sends the gradients back the way
    the rows came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """``EXPERTS`` two-layer MLPs stacked on dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.2)
        self.ep_mesh: DeviceMesh | None = None

    def set_expert_parallel_mesh(self, mesh: DeviceMesh) -> None:
        self.ep_mesh = mesh

    def _run(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row of ``x`` through the local expert ``ids`` names."""
        w1, w2 = _local(self.w1), _local(self.w2)
        out = x.new_zeros(x.shape)
        for e in range(w1.shape[0]):
            rows = (ids == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, F.gelu(x[rows] @ w1[e]) @ w2[e])
        return out

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.ep_mesh is None:
            return self._run(x, ids)
        group, ep, me = self.ep_mesh.get_group(), self.ep_mesh.size(), self.ep_mesh.get_local_rank()
        local = EXPERTS // ep
        owner = ids // local
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        got_ids = ids.new_empty(sum(recv_splits))
        dist.all_to_all_single(got_ids, ids[order].contiguous(), recv_splits, send_splits, group=group)
        got = _AllToAll.apply(x[order], recv_splits, send_splits, group)
        done = self._run(got, got_ids - me * local)
        back = _AllToAll.apply(done, send_splits, recv_splits, group)
        return back[torch.argsort(order)]


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h).reshape(-1, DIM)
        weights, ids = torch.topk(torch.softmax(self.router(x), dim=-1), TOP_K, dim=-1)
        out = self.experts(x.repeat_interleave(TOP_K, dim=0), ids.reshape(-1))
        mixed = (out.reshape(-1, TOP_K, DIM) * weights.unsqueeze(-1)).sum(1)
        return h + mixed.reshape(h.shape)


class TinyMoE(nn.Module):
    _no_split_modules = ["MoEBlock"]
    _fsdptx_expert_modules = ("layers.*.experts",)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(MoEBlock() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def build(seed: int = 0) -> TinyMoE:
    torch.manual_seed(seed)
    return TinyMoE()


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, the mean over this batch."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
