"""The resolver's one entry point, :func:`resolve_units`.

Pure planning: turn a model and its sharding requests into FSDP units. One
model index is built per call (or handed in); cross-block units and then
dtype units are resolved in application order while tracking which modules
are already "sharded" in the plan, exactly as ``fully_shard`` would see them.
Each module is visited a bounded number of times, so planning is linear in
model size. A file of its own because it runs both planners
(:mod:`._cross_block`, :mod:`._dtype_units`), which import
:mod:`._resolver` below it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ...core._caches import caches_enabled
from ...model._index import ModelIndex
from .._types import CrossBlockRequest, DtypeRequest, Unit
from ._cross_block import plan_cross_block_units
from ._dtype_units import plan_dtype_units
from ._keys import low_precision_bulk, param_keys
from ._resolver import _Resolver

__all__ = ["resolve_units"]


def resolve_units(
    model: nn.Module,
    *,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    cross_blocks: Sequence[CrossBlockRequest],
    dtype_request: DtypeRequest | None,
    index: ModelIndex | None = None,
    replay_blocks: bool | None = None,
) -> tuple[Unit, ...]:
    """All units, in application order: cross-block units first (their
    holders are excluded from dtype grouping whatever the transform order;
    a holder's children of other dtypes just before it), then each dtype
    target's children before the target itself. Ignored parameters are
    excluded before anything is planned, so no unit owns them.
    ``replay_blocks=False`` plans every block in full; ``None`` replays
    while caches are on (:func:`fsdptx.caches`)."""
    idx = index or ModelIndex.build(model)
    tokens = dtype_request.fp32_compute_module_names if dtype_request is not None else ()
    keys, frozen, intrinsic = param_keys(idx, mp_policy, tokens)
    r = _Resolver(
        idx, mp_policy, offload_policy, excluded=set(), sharded=set(idx.sharded), keys=keys, frozen=frozen,
        intrinsic=intrinsic, bulk=low_precision_bulk(idx) if intrinsic else None,
    )
    reshard = dtype_request.reshard_after_forward if dtype_request is not None else None
    if dtype_request is not None:
        r.ignore(dtype_request.ignored_params)
    for req in cross_blocks:
        plan_cross_block_units(r, req.blocks, req.names, reshard)
    if dtype_request is not None:
        plan_dtype_units(r, dtype_request, replay_blocks=caches_enabled() if replay_blocks is None else replay_blocks)
    return tuple(r.units)
