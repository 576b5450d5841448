"""Tensor parallelism: the ``tensor_parallel`` transform, the style names it
understands, and the checks a TP plan must pass at a given TP size."""

from ._styles import STYLE_NAMES, GatherSequence, describe_style
from ._transform import check_tensor_parallel, declared_tp_plan, tensor_parallel, tp_styles_by_module

__all__ = [
    "STYLE_NAMES",
    "GatherSequence",
    "check_tensor_parallel",
    "declared_tp_plan",
    "describe_style",
    "tensor_parallel",
    "tp_styles_by_module",
]
