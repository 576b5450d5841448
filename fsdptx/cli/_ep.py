"""Expert parallelism in the traced step: a static token dispatch under a
stated routing assumption.

Under expert parallelism transformers' experts modules send each (token,
expert) pair to the ``ep`` rank holding that expert (an all-to-all whose
split sizes are counted from the router's choices), run the local experts
on what arrived, and send the results back. The split sizes are
data-dependent, which ``FakeTensorMode`` cannot run. Everything else about
the step is not, so during the trace each experts module gets a forward
with the split sizes fixed by an assumption instead of counted:

- ``balanced`` (``skew = 1``): every expert receives the mean number of
  (token, expert) pairs, ``ep x tokens x top_k / num_experts`` (``tokens``
  entering the experts module on each EP rank, every EP rank sending its
  own); the traced rank then receives as many rows as it sends.
- ``skew = F > 1`` (capacity planning): the busiest expert receives ``F``
  times the mean, and the traced rank is taken to hold only such experts,
  an upper bound for the busiest EP rank. An expert receives a token at
  most once, so the count is capped at ``ep x tokens``.

The forward then does what the real dispatch does, at those sizes: gathers
``tokens x top_k`` rows (the send buffer), exchanges them with a real
``all_to_all_single`` on the ``ep`` group (the receive buffer, and in
backward the reverse exchange), runs the local experts' gate/up and down
projections as batched matmuls on their local ``[num_experts / ep, ...]``
weights (the same shapes a grouped GEMM runs, biases and the module's own
gate included), exchanges the outputs back and sums them with the routing
weights. So the tracker counts the all-to-all buffers and the experts'
activations the rank would hold; only the routing is assumed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core._torch_internals import functional_all_to_all

__all__ = ["ExpertRouting", "StaticDispatch", "check_routing_skew", "static_dispatch_problems"]


def check_routing_skew(value: object, where: str) -> float:
    """``value`` as the busiest expert's load over the mean: a real number
    >= 1 (a bool, NaN or infinity is refused).

    Raises:
        TypeError: not a number.
        ValueError: below 1, or not finite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: routing_skew must be a number >= 1 (the busiest expert's load over the mean), got {value!r}")
    skew = float(value)
    if not math.isfinite(skew) or skew < 1:
        raise ValueError(
            f"{where}: routing_skew must be a finite number >= 1 (1 = balanced routing; F = the busiest expert "
            f"receives F times the mean), got {value!r}"
        )
    return skew


@dataclass(frozen=True)
class ExpertRouting:
    """What the traced step assumed about routing, per EP rank (rank 0).

    Attributes:
        ep: ranks the experts are split across.
        skew: the busiest expert's load over the mean (1: balanced).
        tokens: tokens entering each experts module on this rank.
        top_k: experts chosen per token.
        num_experts: experts per module.
        local_experts: experts this rank holds (``num_experts / ep``).
        tokens_per_expert: rows each local expert runs.
        send_rows: (token, expert) pairs this rank sends (``tokens x top_k``).
        recv_rows: rows this rank receives (``local_experts x tokens_per_expert``).
        capped: the skewed count was capped at ``ep x tokens``.
        modules: experts modules traced with this dispatch.
    """

    ep: int
    skew: float
    tokens: int
    top_k: int
    num_experts: int
    local_experts: int
    tokens_per_expert: int
    send_rows: int
    recv_rows: int
    capped: bool
    modules: int

    @property
    def assumption(self) -> str:
        return "balanced" if self.skew == 1 else f"skew {self.skew:g}"

    def to_json(self) -> dict[str, Any]:
        return {
            "routing": "balanced" if self.skew == 1 else "skewed",
            "routing_skew": self.skew,
            "ep": self.ep,
            "tokens_per_rank": self.tokens,
            "top_k": self.top_k,
            "num_experts": self.num_experts,
            "local_experts": self.local_experts,
            "tokens_per_expert": self.tokens_per_expert,
            "send_rows": self.send_rows,
            "recv_rows": self.recv_rows,
            "capped": self.capped,
            "expert_modules": self.modules,
        }

    def note(self) -> str:
        """The ``estimated`` line saying what was assumed."""
        spread = (
            "each expert receives the mean"
            if self.skew == 1
            else f"the busiest expert receives {self.skew:g} x the mean, and every expert of the traced rank is taken "
            "to be that busy (an upper bound for the busiest EP rank)"
        )
        cap = f", capped at ep x tokens = {self.ep * self.tokens}" if self.capped else ""
        return (
            f"expert routing: assumed, not traced ({self.assumption}: {spread}): ep={self.ep}, {self.tokens} tokens x "
            f"top_k {self.top_k} per rank over {self.num_experts} experts -> {self.tokens_per_expert} tokens per "
            f"local expert{cap} ({self.local_experts} local), all-to-all send {self.send_rows} rows / receive "
            f"{self.recv_rows} rows per experts module ({self.modules} modules); the dispatch's buffers and the "
            "experts' activations at those sizes are traced"
        )


def tokens_per_expert(tokens: int, top_k: int, num_experts: int, ep: int, skew: float) -> tuple[int, bool]:
    """Rows each local expert runs under the assumption, and whether the
    cap (an expert receives each of the ``ep x tokens`` tokens at most
    once) cut it."""
    mean = ep * tokens * top_k / num_experts
    want = math.ceil(skew * mean - 1e-9)
    return min(want, ep * tokens), want > ep * tokens


def _even(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` sizes differing by at most one."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local block (differentiable) of a DTensor, the tensor otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def static_dispatch_problems(modules: dict[str, nn.Module]) -> list[str]:
    """Expert modules the static forward cannot stand in for: it runs
    transformers' fused experts layout (``gate_up_proj`` or ``up_proj``,
    and ``down_proj``, every expert on dim 0) with its
    ``(hidden_states, top_k_index, top_k_weights)`` forward."""
    bad = []
    for fqn, module in modules.items():
        params = dict(module.named_parameters(recurse=False))
        up = params.get("gate_up_proj", params.get("up_proj"))
        down = params.get("down_proj")
        from_hf = type(module).__module__.startswith("transformers.")
        if not from_hf or up is None or down is None or up.dim() != 3 or down.dim() != 3:
            bad.append(f"{fqn or '<root>'} ({type(module).__name__})")
    if not bad:
        return []
    return [
        f"the traced step under ep > 1 stands in for the token dispatch of transformers' fused experts modules "
        f"(gate_up_proj/down_proj with every expert on dim 0); {', '.join(bad[:3])}"
        f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''} are not such modules, so their dispatch cannot be "
        "traced (the shape-only figures of `python -m fsdptx plan --moe-mesh ...` without --batch/--seq still hold)"
    ]


@dataclass
class StaticDispatch:
    """A ``hand_ep_mesh`` for the traced step: gives each expert module a
    forward with static dispatch sizes for ``skew`` (see the module
    docstring) and records the sizes it used, once per module."""

    skew: float = 1.0
    seen: dict[int, ExpertRouting] = field(default_factory=dict)

    def __call__(self, module: nn.Module, mesh: DeviceMesh) -> None:
        module.forward = self._forward(module, mesh)

    def routing(self) -> ExpertRouting | None:
        """The assumption as traced (the first module's sizes, with the
        module count); None when no experts module ran."""
        if not self.seen:
            return None
        first = next(iter(self.seen.values()))
        return replace(first, modules=len(self.seen))

    def _forward(self, module: nn.Module, mesh: DeviceMesh) -> Callable[..., torch.Tensor]:
        group, ep = mesh.get_group(), mesh.size()

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
            hs, weights = _local(hidden_states), _local(top_k_weights)
            tokens, hidden = hs.shape
            top_k = top_k_index.shape[-1]
            up, down = _local(_param(module, "gate_up_proj", "up_proj")), _local(_param(module, "down_proj"))
            local = up.shape[0]
            per_expert, capped = tokens_per_expert(tokens, top_k, local * ep, ep, self.skew)
            send_rows, recv_rows = tokens * top_k, local * per_expert
            self.seen.setdefault(
                id(module),
                ExpertRouting(ep, self.skew, tokens, top_k, local * ep, local, per_expert, send_rows, recv_rows, capped, 1),
            )
            send_sizes, recv_sizes = _even(send_rows, ep), _even(recv_rows, ep)
            # the send buffer: each token's row once per chosen expert, as the dispatch gathers them
            send = hs[torch.arange(send_rows, device=hs.device) // top_k]
            recv = functional_all_to_all(send, recv_sizes, send_sizes, group)
            out = _experts(module, recv.view(local, per_expert, hidden), up, down).reshape(recv_rows, hidden)
            back = functional_all_to_all(out, send_sizes, recv_sizes, group)
            combined = (back.view(tokens, top_k, hidden) * weights.unsqueeze(-1).to(back.dtype)).sum(dim=1)
            return combined.to(hs.dtype)

        return forward


def _param(module: nn.Module, *names: str) -> torch.Tensor:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise AttributeError(f"{type(module).__name__} has none of {', '.join(names)}")


def _act(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    act = getattr(module, "act_fn", None)
    if not callable(act):
        raise AttributeError(f"{type(module).__name__} has no act_fn for its experts' activation")
    return act  # type: ignore[no-any-return]


def _experts(module: nn.Module, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The local experts on ``x`` (``[local, rows, hidden]``): what a grouped
    GEMM over equal groups computes, with the module's layout flags
    (transposed weights, biases, gate, post-expert norm) as transformers'
    ``use_experts_implementation`` declares them."""
    transposed = bool(getattr(module, "is_transposed", False))

    def linear(h: torch.Tensor, w: torch.Tensor, bias_name: str) -> torch.Tensor:
        out = torch.bmm(h, w.to(h.dtype) if transposed else w.to(h.dtype).transpose(1, 2))
        bias = getattr(module, bias_name, None) if getattr(module, "has_bias", False) else None
        return out if not isinstance(bias, torch.Tensor) else out + _local(bias).to(out.dtype).unsqueeze(1)

    gated = getattr(module, "has_gate", True) and hasattr(module, "gate_up_proj")
    h = linear(x, up, "gate_up_proj_bias" if gated else "up_proj_bias")
    if gated:
        apply_gate = getattr(module, "_apply_gate", None)
        if callable(apply_gate):
            h = apply_gate(h)
        else:
            gate, lin = h.chunk(2, dim=-1)
            h = _act(module)(gate) * lin
    else:
        h = _act(module)(h)
    h = linear(h, down, "down_proj_bias")
    norm = getattr(module, "post_expert_norm", None) if getattr(module, "has_post_expert_norm", False) else None
    return norm(h) if callable(norm) else h
