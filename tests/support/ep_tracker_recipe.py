"""The plain FSDPMemTracker recipe for a Hugging Face MoE model under expert
parallelism, with the routing forced balanced: the independent figures the
dry run's EP step (:mod:`fsdptx.cli._ep`) is checked against, in fake mode
(``tests/cli/test_cli_expert_parallel_memory.py``,
``benchmarks/memory_check.py``) and on 4 real gloo ranks
(``tests/cli/test_cli_expert_parallel_memory_gloo.py``).

The model is parallelized the way a training job does it,
``FSDP2Manager(config, mesh, moe_mesh).parallelize(model)``: the experts
are split across ``ep`` and get transformers' own all-to-all dispatch
(``AllToAllEP``) and their own ``grouped_mm`` forward, not fsdptx's
static stand-in. Two things are changed, and only these:

- every router picks its experts by a fixed pattern, (token, slot) pair
  ``p`` going to expert ``p % num_experts`` (:func:`force_balanced_routing`),
  so each expert receives ``tokens x top_k / num_experts`` pairs from each
  rank; the routing weights are still the router's softmax at those
  experts, so the router still gets gradients;
- in fake mode, where the dispatch cannot read its split sizes back from
  the device, ``AllToAllEP._dispatch_tokens`` takes them from that pattern
  instead (:func:`split_sizes_from_the_pattern`); everything else in it is
  transformers' code. On real ranks the dispatch is transformers' own,
  only watched (:func:`recorded_split_sizes`).

Then two iterations (forward, fp32 cross entropy, backward, AdamW) under a
plain ``FSDPMemTracker``, as ``tracker_recipe.py`` does; the second
iteration's snapshots are the figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptx.core._torch_internals import own_propagation_fake_mode
from fsdptx.hf import build_hf_model
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh
from tracker_recipe import tracked_two_steps

__all__ = [
    "EP_CONFIG",
    "EXPERTS",
    "TOP_K",
    "EpReference",
    "build_moe",
    "ep_tracker_reference",
    "force_balanced_routing",
    "forced_expert_ids",
    "split_sizes_from_the_pattern",
    "ep_tracker_measured",
    "recorded_split_sizes",
    "tracked_steps",
]

VOCAB, EXPERTS, TOP_K = 256, 8, 2
EP_CONFIG: dict[str, object] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
}
"""Qwen3-MoE at toy size, with experts wide enough (8 of width 128, top-2)
that their activations and all-to-all buffers are a good part of the step's."""


@dataclass(frozen=True)
class EpReference:
    """Bytes per rank the tracker measured, and the rows each experts
    module's dispatch received per call (fake mode: from the pattern)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    received_rows: tuple[int, ...] = ()


def build_moe(
    device: str = "meta", dtype: torch.dtype = torch.float32, config: Mapping[str, object] = EP_CONFIG
) -> nn.Module:
    """A Qwen3-MoE of ``config`` (default :data:`EP_CONFIG`), fp32 master weights."""
    return build_hf_model("qwen3_moe", config, dtype=dtype, device=device)


def forced_expert_ids(tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """``[tokens, top_k]`` expert ids: pair ``p = token x top_k + slot`` goes
    to expert ``p % num_experts`` (distinct experts per token while
    ``top_k <= num_experts``)."""
    return (torch.arange(tokens * top_k, device=device) % num_experts).view(tokens, top_k)


def _forced_router_forward(router: Any) -> Any:
    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        logits = nn.functional.linear(hidden_states, router.weight)
        probs = nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        ids = forced_expert_ids(hidden_states.shape[0], router.top_k, router.num_experts, hidden_states.device)
        weights = probs.gather(-1, ids)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids

    return forward


def force_balanced_routing(model: nn.Module) -> int:
    """Give every Qwen3-MoE router (``mlp.gate``) the fixed pattern of
    :func:`forced_expert_ids`; returns how many it changed."""
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]
    for router in routers:
        setattr(router, "forward", _forced_router_forward(router))
    return len(routers)


_HF_EP = "transformers.distributed.expert_parallel"


@contextlib.contextmanager
def split_sizes_from_the_pattern() -> Iterator[list[int]]:
    """transformers' ``AllToAllEP._dispatch_tokens`` with the split sizes
    of the forced pattern instead of read back from the device (which fake
    tensors cannot do): each rank sends ``tokens x top_k / num_experts``
    pairs to each expert and receives as many for each of its own. Yields
    the rows each dispatch received, one entry per call."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    hf_ep: Any = importlib.import_module(_HF_EP)
    original = hf_ep.AllToAllEP._dispatch_tokens
    received: list[int] = []

    def dispatch(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
        assert self.tp_mesh.size() == 1, "the recipe runs without TP"
        num_tokens = hidden_states.size(0)
        ep_group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
        num_top_k = top_k_index.size(-1)
        experts = self.num_local_experts * ep_size
        per_expert, rest = divmod(num_tokens * num_top_k, experts)
        assert rest == 0, "the forced pattern is balanced only when tokens x top_k divides by num_experts"
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids)
        send_tokens = hidden_states[order // num_top_k]
        # what the count exchange would have given: the same on every rank
        recv_counts = torch.full((ep_size, self.num_local_experts), per_expert, device=hidden_states.device)
        send_sizes = recv_sizes = [per_expert * self.num_local_experts] * ep_size
        recv_tokens = all_to_all_single_autograd(send_tokens, recv_sizes, send_sizes, ep_group)
        recv_tokens = hf_ep._WaitTensor.apply(recv_tokens)
        recv_expert_ids = torch.arange(self.num_local_experts, device=hidden_states.device).repeat(ep_size)
        recv_expert_ids = recv_expert_ids.repeat_interleave(recv_counts.reshape(-1), output_size=sum(recv_sizes))
        recv_expert_ids = recv_expert_ids.unsqueeze(-1)
        recv_weights = torch.ones_like(recv_expert_ids, dtype=recv_tokens.dtype)
        state = hf_ep._AllToAllState(top_k_weights, order, send_sizes, recv_sizes, num_tokens)
        received.append(sum(recv_sizes))
        return recv_tokens, recv_expert_ids, recv_weights, state

    hf_ep.AllToAllEP._dispatch_tokens = dispatch
    try:
        yield received
    finally:
        hf_ep.AllToAllEP._dispatch_tokens = original


@contextlib.contextmanager
def recorded_split_sizes() -> Iterator[list[int]]:
    """transformers' ``AllToAllEP._dispatch_tokens`` as it is, recording
    the rows each call received (on real ranks: read back from the
    routing)."""
    hf_ep: Any = importlib.import_module(_HF_EP)
    original = hf_ep.AllToAllEP._dispatch_tokens
    received: list[int] = []

    def dispatch(self: Any, *args: torch.Tensor) -> Any:
        out = original(self, *args)
        received.append(sum(out[3].recv_sizes))
        return out

    hf_ep.AllToAllEP._dispatch_tokens = dispatch
    try:
        yield received
    finally:
        hf_ep.AllToAllEP._dispatch_tokens = original


def tracked_steps(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> EpReference:
    """Two training iterations of the parallelized ``model`` under a plain
    ``FSDPMemTracker`` (the dense recipe's); the second's snapshots."""
    measured = tracked_two_steps(model, lambda t: model(input_ids=t).logits, tokens, labels)
    return EpReference(**dataclasses.asdict(measured))


def moe_meshes(dense: tuple[int, ...], dense_names: tuple[str, ...], moe: tuple[int, ...], moe_names: tuple[str, ...]) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense and MoE meshes over the current default process group."""
    return (
        init_device_mesh("cpu", dense, mesh_dim_names=dense_names),
        init_device_mesh("cpu", moe, mesh_dim_names=moe_names),
    )


def ep_tracker_reference(
    batch: int,
    seq: int,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    moe_shape: tuple[int, ...],
    moe_names: tuple[str, ...],
    config: FSDP2Config,
    model_config: Mapping[str, object] = EP_CONFIG,
) -> EpReference:
    """The recipe in ``FakeTensorMode`` on a fake mesh, rank 0, for the
    Qwen3-MoE of ``model_config``."""
    with torch.device("meta"):
        model = build_moe(config=model_config)
    vocab = int(str(model_config["vocab_size"]))
    force_balanced_routing(model)
    with fake_mesh(shape, names) as mesh:
        moe_mesh = init_device_mesh("cpu", moe_shape, mesh_dim_names=moe_names)
        FSDP2Manager(config, mesh, moe_mesh).parallelize(model)
        with FakeTensorMode(allow_non_fake_inputs=True), own_propagation_fake_mode(), split_sizes_from_the_pattern() as received:
            model.to_empty(device="cpu")
            tokens = torch.randint(0, vocab, (batch, seq))
            labels = torch.randint(0, vocab, (batch, seq))
            measured = tracked_steps(model, tokens, labels)
    return replace(measured, received_rows=tuple(received))


def ep_tracker_measured(
    rank: int,
    batch: int,
    seq: int,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    moe_shape: tuple[int, ...],
    moe_names: tuple[str, ...],
    config: FSDP2Config,
) -> EpReference:
    """The recipe on real CPU tensors, on this gloo rank of a running
    process group: the model built on every rank from the same seed, the
    dispatch transformers' own (real split sizes, read back from the
    forced routing), each rank its own random tokens."""
    torch.manual_seed(0)
    model = build_moe(device="cpu")
    force_balanced_routing(model)
    mesh, moe_mesh = moe_meshes(shape, names, moe_shape, moe_names)
    FSDP2Manager(config, mesh, moe_mesh).parallelize(model)
    g = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    with recorded_split_sizes() as received:
        measured = tracked_steps(model, tokens, labels)
    return replace(measured, received_rows=tuple(received))
