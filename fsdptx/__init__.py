"""fsdptx: composable, functional FSDP2 and tensor-parallel sharding.

Plan purely, apply once::

    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
    p = fsdptx.plan(model, pipeline, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    print(p)
    fsdptx.apply_plan(p, model, mesh)
    ...
    loss.backward()
    fsdptx.synchronize_tp_replica_gradients([model], mesh)   # once per optimizer step
"""

import warnings

# torch warns "Failed to initialize NumPy" on import when numpy is missing;
# fsdptx depends on torch alone and never needs numpy, so that warning is
# only noise (it would be the first line of every `python -m fsdptx plan`).
# Scoped to this import: no filter stays installed.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch  # noqa: F401

from .planning._apply import PlanMismatchError, apply_plan, check_plan
from .core._chunks import DEFAULT_MAX_BUFFER_BYTES, gradient_chunks
from .core._dtypes import gradient_reduce_dtype, group_params_by_dtype, make_compute_dtype_fn
from .planning._diff import PlanDiff, diff_plans
from .planning._json import plan_from_json, plan_to_json
from .planning._imperative import (
    ParameterSet,
    configure_fsdp_unused_param_reduction,
    fully_shard_across_blocks,
    fully_shard_by_dtype,
    reject_unsupported_mtp_cp,
    reject_unsupported_mtp_cp_pp,
)
from .tp._audit import Drift, ReplicaAudit, audit_replicas, audit_replicas_every
from .tp._marks import exclude_from_tp_replica_sync, mark_tp_replica_gradient_reduction
from .planning._plan import Checkpointing, Plan, Prefetch, Reduction, TensorParallel, TPAssignment, Unit
from .planning._planner import PlanningError
from .planning._refine import checkpoint_activations, prefetch, reduce_unused_params, reshard_policy
from .core._policy import get_internal_fsdp_mp_policy, mp_policy_with_param_dtype
from .tp._replicas import (
    broadcast_tp_replicas,
    is_tp_replicated,
    synchronize_tp_replica_gradients,
)
from .planning._transforms import (
    Transform,
    compose,
    mark_reduction,
    plan,
    shard_across_blocks,
    shard_by_dtype,
)
from .manager import FSDP2Config, FSDP2Manager, gradient_sync_context, patch_is_packed_sequence
from .tp import loss_parallel, tensor_parallel
from .core._tree import (
    get_module_from_path,
    iter_maximal_uniform_dtype_subtrees,
    iter_unique_named_buffers,
    iter_unique_named_parameters,
)

__all__ = [
    "Checkpointing",
    "DEFAULT_MAX_BUFFER_BYTES",
    "Drift",
    "FSDP2Config",
    "FSDP2Manager",
    "Prefetch",
    "TPAssignment",
    "TensorParallel",
    "checkpoint_activations",
    "gradient_sync_context",
    "patch_is_packed_sequence",
    "prefetch",
    "reduce_unused_params",
    "reshard_policy",
    "tensor_parallel",
    "ParameterSet",
    "Plan",
    "PlanDiff",
    "PlanMismatchError",
    "PlanningError",
    "Reduction",
    "ReplicaAudit",
    "Transform",
    "Unit",
    "apply_plan",
    "audit_replicas",
    "audit_replicas_every",
    "broadcast_tp_replicas",
    "check_plan",
    "compose",
    "diff_plans",
    "configure_fsdp_unused_param_reduction",
    "exclude_from_tp_replica_sync",
    "fully_shard_across_blocks",
    "fully_shard_by_dtype",
    "get_internal_fsdp_mp_policy",
    "get_module_from_path",
    "gradient_chunks",
    "gradient_reduce_dtype",
    "group_params_by_dtype",
    "is_tp_replicated",
    "iter_maximal_uniform_dtype_subtrees",
    "iter_unique_named_buffers",
    "iter_unique_named_parameters",
    "loss_parallel",
    "make_compute_dtype_fn",
    "mark_reduction",
    "mark_tp_replica_gradient_reduction",
    "mp_policy_with_param_dtype",
    "plan",
    "plan_from_json",
    "plan_to_json",
    "reject_unsupported_mtp_cp",
    "reject_unsupported_mtp_cp_pp",
    "shard_across_blocks",
    "shard_by_dtype",
    "synchronize_tp_replica_gradients",
]
