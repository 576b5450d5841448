"""The transforms ``(model, Plan) -> Plan``, one file per concern.

Each transform is usable bare (its defaults come from what the model
declares) or configured with keyword-only options through
``functools.partial``. None of them touches the model: they read it and
return a new Plan. How transforms are chained and run (``compose``,
``plan``) is :mod:`fsdptx.plan._compose`, below this subpackage.

- ``_shard``: the sharding transforms ``shard_by_dtype`` and
  ``shard_across_blocks`` (and ``sharding_transform`` and ``block_fqns``,
  which other transforms share);
- ``_marks``: ``mark_reduction``, TP-replica gradient reductions and
  exclusions;
- ``_refine``: ``checkpoint_activations``, ``reshard_policy``, ``prefetch``,
  ``reduce_unused_params`` (and ``block_units``);
- ``_expert_parallel``: ``expert_parallel`` (and ``EP_HOOK``, ``uneven_experts``).
"""

from ._expert_parallel import EP_HOOK, expert_parallel, uneven_experts
from ._marks import mark_reduction
from ._refine import block_units, checkpoint_activations, prefetch, reduce_unused_params, reshard_policy
from ._shard import block_fqns, shard_across_blocks, shard_by_dtype

__all__ = [
    "EP_HOOK",
    "block_fqns",
    "block_units",
    "checkpoint_activations",
    "expert_parallel",
    "mark_reduction",
    "prefetch",
    "reduce_unused_params",
    "reshard_policy",
    "shard_across_blocks",
    "shard_by_dtype",
    "uneven_experts",
]
