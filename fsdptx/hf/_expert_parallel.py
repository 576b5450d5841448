"""Token dispatch for Hugging Face experts under fsdptx's expert parallelism.

transformers' fused experts modules (``Qwen3MoeExperts``,
``DeepseekV3NaiveMoe``'s experts, ...) take ``(hidden_states, top_k_index,
top_k_weights)`` and keep every expert on dim 0 of ``gate_up_proj`` /
``down_proj``. transformers ships the all-to-all dispatch that runs such a
module on its local experts (``EpDispatchExpertsParallel``, what its
``ep_dispatch_experts`` plan entries name); fsdptx installs it on each
expert module once the weights are split, instead of requiring a
``set_expert_parallel_mesh`` method the module does not have.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core._torch_internals import unflatten_mesh

__all__ = ["hf_dispatches_experts", "install_hf_expert_dispatch"]

_EP_MODULE = "transformers.distributed.expert_parallel"


def _dispatch_style() -> Any | None:
    """transformers' dispatching EP style class, or None when this
    transformers has none (or is not installed)."""
    try:
        return getattr(importlib.import_module(_EP_MODULE), "EpDispatchExpertsParallel", None)
    except ImportError:
        return None


def hf_dispatches_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module whose tokens
    transformers' own EP dispatch can route: defined by transformers, with
    an int ``num_experts``, and a transformers that ships the dispatch."""
    from_hf = type(module).__module__.startswith("transformers.")
    return from_hf and type(getattr(module, "num_experts", None)) is int and _dispatch_style() is not None


def install_hf_expert_dispatch(module: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Make ``module``'s forward send each (token, expert) pair to the
    ``ep`` rank holding that expert and run only its local experts.

    The module must already hold its ``num_experts / ep`` experts (the
    DTensor ``Shard(0)`` fsdptx placed): its ``num_experts`` becomes the
    local count, as transformers' dispatch reads it. Each rank dispatches
    its own tokens (transformers' "ranks sharing a batch" group is this
    rank alone); TP peers that feed the experts the same tokens are counted
    in the experts' gradient divide factor instead.

    Args:
        module: a module :func:`hf_dispatches_experts` accepts.
        ep_mesh: the 1-D ``ep`` mesh its experts are split across.
    """
    style = _dispatch_style()
    if style is None:
        raise RuntimeError(f"{_EP_MODULE} has no EpDispatchExpertsParallel; upgrade transformers")
    alone = unflatten_mesh(ep_mesh, 0, (ep_mesh.size(), 1), ("ep_groups", "ep_own_batch"))["ep_own_batch"]
    total: int = getattr(module, "num_experts")
    setattr(module, "num_experts", total // ep_mesh.size())
    style().install_forward(module, ep_mesh, tp_mesh=alone)
