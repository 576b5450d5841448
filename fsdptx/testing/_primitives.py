"""Stand-ins for ``fully_shard`` that tests and benchmarks pass as ``shard_module``."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["mark_sharded"]

_SHARDED_CLASSES: dict[type, type] = {}


def mark_sharded(target: nn.Module | list[nn.Module], **kwargs: object) -> None:
    """Do to each module's class what ``fully_shard`` does (it becomes an
    ``FSDPModule`` subclass), and nothing else: no parameter changes, no
    process group. Later planning then sees these modules as units and stops
    there, as it would after real sharding, at no cost.

    Args:
        target: a module, or the modules of one multi-module unit.
        **kwargs: ``fully_shard``'s keyword arguments, ignored.

    Example::

        fsdptx.apply_plan(p, model, mesh, shard_module=fsdptx.testing.mark_sharded)
    """
    del kwargs
    for m in target if isinstance(target, list) else [target]:
        cls = type(m)
        sharded = _SHARDED_CLASSES.get(cls)
        if sharded is None:
            sharded = _SHARDED_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        # object's own setattr: nn.Module.__setattr__ would first search the
        # module's parameter, buffer and child tables for "__class__".
        object.__setattr__(m, "__class__", sharded)
