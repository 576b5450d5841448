"""Resolving sharding requests into FSDP units: the planner.

A Plan records what to shard (a :class:`~fsdptx.plan._types.DtypeRequest`,
:class:`~fsdptx.plan._types.CrossBlockRequest` s); this subpackage turns
those requests into the units ``fully_shard`` will be called with, as pure
functions of the model. Files, lowest first (each imports only those before
it):

- ``_claim``: what ``fully_shard`` would claim (``claim``) and reach (the
  survey);
- ``_keys``: dtype keys (``param_keys``) and unit policies (``unit_policy``);
- ``_resolver``: the per-resolution state (``_Resolver``) units are
  recorded in;
- ``_target``: the target's survey, the descent, and ``_plan_target`` (one
  block or the root);
- ``_replay``: block replay (``_BlockReplay``), the optional fast path,
  reached only through ``plan_dtype_units`` and off under
  ``fsdptx.caches(enabled=False)``;
- ``_dtype_units``: ``plan_dtype_units``, every target of the dtype request;
- ``_cross_block``: ``plan_cross_block_units``, one unit per name across
  blocks;
- ``_units``: ``resolve_units``, the entry point running both.

Other modules need only ``resolve_units`` (``plan._compose``, ``compat``)
and ``claim`` (``apply``'s checks).
"""

from ._claim import claim
from ._units import resolve_units

__all__ = ["claim", "resolve_units"]
