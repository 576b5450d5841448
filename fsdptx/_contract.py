"""The contract: every public name, imported from where it is defined, and
``__all__``. ``fsdptx`` gives these names, loading this module the first
time one is read (see ``fsdptx/__init__.py``), so ``import fsdptx`` alone
imports no torch."""

# The contract: every public name, grouped by layer (see docs/architecture.md).
# Sorted within each section.

# core: pure building blocks
from .core._caches import caches, clear_caches
from .core._chunks import DEFAULT_MAX_BUFFER_BYTES, gradient_chunks
from .core._dtypes import gradient_reduce_dtype, group_params_by_dtype, make_compute_dtype_fn
from .core._policy import get_internal_fsdp_mp_policy, mp_policy_with_param_dtype
from .core._tree import (
    get_module_from_path,
    iter_maximal_uniform_dtype_subtrees,
    iter_unique_named_buffers,
    iter_unique_named_parameters,
)

# model: the walk and the model index
from .model._index import PlanningError

# plan: the Plan, its transforms, and plan files
from .plan._compose import Transform, compose, plan
from .plan._diff import PlanDiff, diff_plans
from .plan._json import plan_from_json, plan_to_json
from .plan._plan import Pipeline, Plan, Stage
from .plan._stages import PipelineParallelConfig, plan_pipeline
from .plan._types import Checkpointing, ExpertParallel, Prefetch, Reduction, TPAssignment, TensorParallel, Unit
from .plan.transforms import (
    checkpoint_activations,
    expert_parallel,
    mark_reduction,
    prefetch,
    reduce_unused_params,
    reshard_policy,
    shard_across_blocks,
    shard_by_dtype,
)

# tp: tensor/sequence parallelism, TP-replica marks, sync and audit
from .tp import loss_parallel, tensor_parallel
from .tp._audit import Drift, ReplicaAudit, audit_replicas
from .tp._audit_every import audit_replicas_every
from .tp._marks import exclude_from_tp_replica_sync, mark_tp_replica_gradient_reduction
from .tp.sync._context import is_tp_replicated
from .tp.sync._ops import broadcast_tp_replicas, synchronize_tp_replica_gradients

# apply: carrying a plan out
from .apply._apply import apply_plan
from .apply._check import PlanMismatchError, check_plan
from .apply._clip import clip_grad_norm_
from .apply._pipeline import PipelineStages, apply_pipeline
from .apply._unused import configure_fsdp_unused_param_reduction

# compat: the seed-compatible imperative API and the MTP guards
from .compat._imperative import (
    ParameterSet,
    fully_shard_across_blocks,
    fully_shard_by_dtype,
    reject_unsupported_mtp_cp,
    reject_unsupported_mtp_cp_pp,
)

# manager: the all-in-one entry point
from .manager import FSDP2Config, FSDP2Manager, gradient_sync_context, patch_is_packed_sequence

# cli: the dry run's memory estimate of one traced training step
from .cli._memory import MemoryEstimate, estimate_memory
from .cli._pipeline_memory import PipelineMemoryEstimate, PipelineRankMemory, estimate_pipeline_memory

__all__ = [
    # core
    "DEFAULT_MAX_BUFFER_BYTES",
    "caches",
    "clear_caches",
    "get_internal_fsdp_mp_policy",
    "get_module_from_path",
    "gradient_chunks",
    "gradient_reduce_dtype",
    "group_params_by_dtype",
    "iter_maximal_uniform_dtype_subtrees",
    "iter_unique_named_buffers",
    "iter_unique_named_parameters",
    "make_compute_dtype_fn",
    "mp_policy_with_param_dtype",
    # model
    "PlanningError",
    # plan
    "Checkpointing",
    "ExpertParallel",
    "Pipeline",
    "PipelineParallelConfig",
    "Plan",
    "PlanDiff",
    "Prefetch",
    "Reduction",
    "Stage",
    "TPAssignment",
    "TensorParallel",
    "Transform",
    "Unit",
    "checkpoint_activations",
    "compose",
    "diff_plans",
    "expert_parallel",
    "mark_reduction",
    "plan",
    "plan_from_json",
    "plan_pipeline",
    "plan_to_json",
    "prefetch",
    "reduce_unused_params",
    "reshard_policy",
    "shard_across_blocks",
    "shard_by_dtype",
    # tp
    "Drift",
    "ReplicaAudit",
    "audit_replicas",
    "audit_replicas_every",
    "broadcast_tp_replicas",
    "exclude_from_tp_replica_sync",
    "is_tp_replicated",
    "loss_parallel",
    "mark_tp_replica_gradient_reduction",
    "synchronize_tp_replica_gradients",
    "tensor_parallel",
    # apply
    "PipelineStages",
    "PlanMismatchError",
    "apply_pipeline",
    "apply_plan",
    "check_plan",
    "clip_grad_norm_",
    "configure_fsdp_unused_param_reduction",
    # compat
    "ParameterSet",
    "fully_shard_across_blocks",
    "fully_shard_by_dtype",
    "reject_unsupported_mtp_cp",
    "reject_unsupported_mtp_cp_pp",
    # manager
    "FSDP2Config",
    "FSDP2Manager",
    "gradient_sync_context",
    "patch_is_packed_sequence",
    # cli
    "MemoryEstimate",
    "PipelineMemoryEstimate",
    "PipelineRankMemory",
    "estimate_memory",
    "estimate_pipeline_memory",
]
