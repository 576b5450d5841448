"""What ``fully_shard`` would refuse in a unit on its own: its settings and
its modules. Both the full check and vouching read these, so a plan is only
vouched for when the primitive would accept every unit as it stands. (The
settings check reads a plan Unit, so it is in the plan layer:
:func:`fsdptx.plan._vouch.settings_problems`.)"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["container_classes", "is_container", "module_problems", "refused_class"]


def is_container(module: nn.Module) -> bool:
    """``fully_shard`` rejects ModuleList/ModuleDict that do not define forward."""
    return _container_class(type(module))


def _container_class(cls: type) -> bool:
    """Whether modules of class ``cls`` are containers (:func:`is_container`)."""
    return issubclass(cls, (nn.ModuleList, nn.ModuleDict)) and cls.forward is nn.Module.forward


def refused_class(cls: type) -> bool:
    """Whether ``fully_shard`` refuses every module of class ``cls`` as a
    unit module (:func:`module_problems` says why): an FSDP module, or a
    ModuleList/ModuleDict without forward."""
    return issubclass(cls, FSDPModule) or _container_class(cls)


def container_classes(types: Iterable[type]) -> frozenset[tuple[type, bool]]:
    """Each ModuleList/ModuleDict class among ``types`` with whether it is a
    container (:func:`is_container`). That depends on the class's
    ``forward``, which a patch may add or remove after a class was seen:
    whatever is derived from classes by identity keeps this next to them."""
    return frozenset(
        (t, _container_class(t)) for t in set(types) if issubclass(t, (nn.ModuleList, nn.ModuleDict))
    )


def module_problems(i: int, fqns: tuple[str, ...], mods: list[nn.Module]) -> list[str]:
    """A unit module must not be an FSDP module already, nor a container
    without forward (which ``fully_shard`` rejects)."""
    problems = []
    for fqn, m in zip(fqns, mods):
        if isinstance(m, FSDPModule):
            problems.append(f"unit {i}: module {fqn!r} is already sharded (an FSDP module)")
        elif is_container(m):
            problems.append(
                f"unit {i}: module {fqn!r} is a {type(m).__name__} without forward, which "
                "fully_shard rejects; plan its elements instead"
            )
    return problems
