"""What ``fully_shard`` would refuse in a unit on its own: its settings and
its modules. Both the full check and vouching read these, so a plan is only
vouched for when the primitive would accept every unit as it stands."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

if TYPE_CHECKING:
    from ..plan._types import Unit  # the one upward edge left: see tests/test_layers.py

__all__ = ["container_classes", "is_container", "module_problems", "settings_problems"]


def is_container(module: nn.Module) -> bool:
    """``fully_shard`` rejects ModuleList/ModuleDict that do not define forward."""
    return (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    )


def container_classes(types: Iterable[type]) -> frozenset[tuple[type, bool]]:
    """Each ModuleList/ModuleDict class among ``types`` with whether it is a
    container (:func:`is_container`). That depends on the class's
    ``forward``, which a patch may add or remove after a class was seen:
    whatever is derived from classes by identity keeps this next to them."""
    return frozenset(
        (t, t.forward is nn.Module.forward) for t in set(types) if issubclass(t, (nn.ModuleList, nn.ModuleDict))
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


def settings_problems(i: int, unit: Unit) -> list[str]:
    """What the primitive would refuse in the unit's own settings."""
    problems: list[str] = []
    if unit.mp_policy is not None and not isinstance(unit.mp_policy, MixedPrecisionPolicy):
        problems.append(f"unit {i}: mp_policy {unit.mp_policy!r} is not a MixedPrecisionPolicy or None")
    if unit.offload_policy is not None and not isinstance(unit.offload_policy, OffloadPolicy):
        problems.append(f"unit {i}: offload_policy {unit.offload_policy!r} is not an OffloadPolicy or None")
    if unit.mesh not in ("dp", "moe"):
        problems.append(f"unit {i}: mesh {unit.mesh!r} is neither 'dp' nor 'moe'")
    r = unit.reshard_after_forward
    if not (r is None or isinstance(r, bool) or (isinstance(r, int) and r >= 1)):
        problems.append(f"unit {i}: reshard_after_forward={r!r} is not None, a bool or a positive int")
    return problems
