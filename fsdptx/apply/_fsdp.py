"""FSDP units as ``apply_plan`` hands them to the sharding primitive: each
unit's keyword arguments, the dense and expert meshes, and parameters
looked up live (tensor parallelism may have replaced them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core._meshes import fsdp_mesh, moe_fsdp_mesh
from ..plan._plan import Plan
from ..plan._types import Unit
from ..core._policy import primitive_policy

__all__ = [
    "fsdp_meshes",
    "live_param",
    "shard_kwargs",
]


def shard_kwargs(unit: Unit, mesh: object) -> dict[str, Any]:
    """Keyword arguments for the primitive. ``reshard_after_forward=None`` and a
    ``None`` offload policy are left out so the primitive's defaults apply; a
    ``None`` mixed-precision policy becomes ``MixedPrecisionPolicy()``."""
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": primitive_policy(unit.mp_policy)}
    if unit.offload_policy is not None:
        kwargs["offload_policy"] = unit.offload_policy
    if unit.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = unit.reshard_after_forward
    return kwargs


def live_param(find: Callable[[str], nn.Module], fqn: str) -> nn.Parameter:
    """Look a parameter up now: sharding an earlier unit may have replaced it."""
    module_fqn, _, name = fqn.rpartition(".")
    p = find(module_fqn)._parameters[name]
    assert p is not None
    return p


def fsdp_meshes(plan: Plan, mesh: object, moe_mesh: DeviceMesh | None) -> tuple[object, object]:
    if not plan.units:
        return mesh, None
    dense = fsdp_mesh(mesh) if isinstance(mesh, DeviceMesh) else mesh
    moe = moe_fsdp_mesh(moe_mesh, mesh) if moe_mesh is not None and isinstance(mesh, DeviceMesh) else None
    return dense, moe
