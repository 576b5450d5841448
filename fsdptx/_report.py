"""What one training step communicates, derived from a Plan alone (pure).

FSDP2 issues, per unit with parameters: one all-gather before forward, one
more before backward if the unit was resharded after forward, and one
reduce-scatter after backward. Checked against ``fully_shard`` on a fake mesh
(tests/test_report.py); what decides "resharded after forward":

- ``None`` (FSDP2's default) means ``True``, except for the FSDP root: the
  first unit to run forward (the model root, ``""``, which the default
  pipeline always plans) keeps its parameters, since backward would gather
  them again at once. An explicit ``True`` on the root is honoured.
- ``False``, and cross-block units (planned with ``False``): one all-gather.
- An int is a group size to reshard to: ``1`` is turned into ``False`` by
  FSDP2 (one all-gather); any other valid size reshards (two all-gathers).

A unit whose forward ignores its input (an fp32 holder such as attention
sinks) still gets its one reduce-scatter: when its post-backward hook does not
fire, FSDP2's root reduces it in the end-of-backward callback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._plan import Plan, Unit, reshards_after_forward

__all__ = ["UnitTraffic", "step_traffic"]


@dataclass(frozen=True)
class UnitTraffic:
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int


def _traffic(unit: Unit) -> UnitTraffic:
    if unit.numel == 0:
        return UnitTraffic(0, 0, 0, 0)
    storage = unit.storage_dtype or torch.float32
    policy = unit.mp_policy
    gather_dtype = (policy.param_dtype if policy else None) or storage
    reduce_dtype = (policy.reduce_dtype if policy else None) or gather_dtype
    gathers = 2 if reshards_after_forward(unit) else 1
    return UnitTraffic(
        all_gathers=gathers,
        reduce_scatters=1,
        all_gather_bytes=gathers * unit.numel * gather_dtype.itemsize,
        reduce_scatter_bytes=unit.numel * reduce_dtype.itemsize,
    )


def step_traffic(plan: Plan) -> tuple[UnitTraffic, ...]:
    """Per unit, the FSDP collectives and unsharded bytes of one forward+backward."""
    return tuple(_traffic(u) for u in plan.units)
