"""Activation checkpointing as ``apply_plan`` carries it out: the
selective-checkpoint policy (which ops' outputs are kept) and turning a
model's KV cache off, which checkpointing's recomputation cannot replay."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..core._torch_internals import CHECKPOINT_WRAPPED, CachedTorchDispatchMode, composable_registry
from ..model._index import ModelIndex, kv_cache_configs

__all__ = [
    "is_checkpointed",
    "selective_context",
    "turn_kv_cache_off",
    "turn_kv_cache_off_warning",
]


logger = logging.getLogger(__name__)


def turn_kv_cache_off(model: nn.Module, modules: Iterable[tuple[str, nn.Module]] | None = None) -> list[str]:
    """Set every ``use_cache`` that is on to ``False``; returns where (paths
    such as ``model.config.use_cache``).

    A forward that fills a KV cache recomputes a different op sequence in
    backward than it ran (the cache has grown by then), which checkpointing
    cannot replay; a training forward never needs the cache. Hugging Face's
    own gradient checkpointing and the reference turn it off the same way.
    Each distinct config object the modules hold is visited (a multimodal
    model's language model reads its text config, not the top-level one).
    ``modules``: the model's ``(FQN, module)`` pairs, when the caller has
    them from an index (default ``model.named_modules()``)."""
    found = kv_cache_configs(model.named_modules() if modules is None else modules)
    for _path, config in found:
        setattr(config, "use_cache", False)
    return [path for path, _config in found]


def turn_kv_cache_off_warning(model: nn.Module, index: ModelIndex | None) -> None:
    """:func:`turn_kv_cache_off`, with a warning naming each switch."""
    for path in turn_kv_cache_off(model, None if index is None else index.modules.items()):
        logger.warning(
            "activation checkpointing: set %s = False (a KV cache filled in a checkpointed forward "
            "cannot be recomputed in backward)",
            path,
        )


def is_checkpointed(module: nn.Module) -> bool:
    """Composable ``checkpoint`` registers itself on the module; the wrapper
    API puts the block inside a ``_checkpoint_wrapped_module``."""
    return "checkpoint" in (composable_registry(module) or {}) or CHECKPOINT_WRAPPED in module._modules


# Ops whose outputs selective checkpointing keeps: the costly ones
# (matrix multiplications, attention). Everything else (elementwise ops,
# norms, activations) is cheap to recompute and is not kept.
_SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


def _selective_policy(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if str(op) in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _RecomputeMode(CachedTorchDispatchMode):
    """Selective checkpointing's replay, letting profiler ops through.

    Composable ``checkpoint`` sits on the module FSDP shards, and FSDP's
    pre-forward hook runs before checkpointing starts in forward but inside
    the replay in backward; its ``record_function`` ranges (the input cast
    of a bf16 policy) would then be ops the replay never saw and fail it.
    They compute nothing, so they run as they are.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace == "profiler":
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[no-untyped-call]


def selective_context() -> tuple[Any, Any]:
    caching, cached = create_selective_checkpoint_contexts(_selective_policy)
    return caching, _RecomputeMode(_selective_policy, cached.storage)
