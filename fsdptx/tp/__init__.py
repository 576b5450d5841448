"""Tensor parallelism: the ``tensor_parallel`` transform and the style names
it understands (``_styles``, ``_transform``; ``_experts`` for MoE experts
split inside every expert), the TP-replica marks
(``_marks``), the replica broadcast and gradient synchronization
(``sync/``) and the replica audit (``_audit``)."""

from ._experts import EXPERT_PARAM_STYLES, EXPERTS_STYLE, ExpertsParallel
from ._styles import STYLE_NAMES, ExpertsSequence, GatherSequence, ShardSequence, WholeSequence, describe_style
from ._loss import loss_parallel
from ._transform import (
    check_tensor_parallel,
    declared_tp_plan,
    tensor_parallel,
    tp_styles_by_module,
    without_tensor_parallel,
)

__all__ = [
    "EXPERTS_STYLE",
    "EXPERT_PARAM_STYLES",
    "STYLE_NAMES",
    "ExpertsParallel",
    "ExpertsSequence",
    "GatherSequence",
    "ShardSequence",
    "WholeSequence",
    "check_tensor_parallel",
    "declared_tp_plan",
    "describe_style",
    "loss_parallel",
    "tensor_parallel",
    "tp_styles_by_module",
    "without_tensor_parallel",
]
