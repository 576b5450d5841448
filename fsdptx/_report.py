"""What one training step communicates, derived from a Plan alone (pure).

FSDP2 issues, per unit with parameters: one all-gather before forward, one
more before backward if the unit was resharded after forward, and one
reduce-scatter after backward. The model root keeps its parameters after
forward by default (``reshard_after_forward=None`` means False there), and
cross-block units are planned with ``False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._plan import Plan, Unit

__all__ = ["UnitTraffic", "step_traffic"]


@dataclass(frozen=True)
class UnitTraffic:
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int


def _resharded(unit: Unit) -> bool:
    if unit.reshard_after_forward is None:
        return unit.modules != ("",)
    return unit.reshard_after_forward is not False


def _traffic(unit: Unit) -> UnitTraffic:
    if unit.numel == 0:
        return UnitTraffic(0, 0, 0, 0)
    storage = unit.storage_dtype or torch.float32
    policy = unit.mp_policy
    gather_dtype = (policy.param_dtype if policy else None) or storage
    reduce_dtype = (policy.reduce_dtype if policy else None) or gather_dtype
    gathers = 2 if _resharded(unit) else 1
    return UnitTraffic(
        all_gathers=gathers,
        reduce_scatters=1,
        all_gather_bytes=gathers * unit.numel * gather_dtype.itemsize,
        reduce_scatter_bytes=unit.numel * reduce_dtype.itemsize,
    )


def step_traffic(plan: Plan) -> tuple[UnitTraffic, ...]:
    """Per unit, the FSDP collectives and unsharded bytes of one forward+backward."""
    return tuple(_traffic(u) for u in plan.units)
