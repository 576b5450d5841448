"""Hugging Face ``transformers`` support (the ``hf`` extra).

Declaration readers (:func:`hf_tp_plan`, :func:`hf_fp32_compute_tokens`,
:func:`hf_tied_weights`, :func:`hf_replica_reductions`,
:func:`hf_expert_modules`) read attributes off any module and never import
``transformers``; :func:`build_hf_model` and :func:`patch_is_packed_sequence`
import it on call. Importing this package therefore works with torch alone.
"""

from ._build import build_hf_model
from ._patches import patch_is_packed_sequence
from ._declarations import (
    hf_expert_modules,
    hf_fp32_compute_tokens,
    hf_replica_reductions,
    hf_tied_weights,
    hf_tp_plan,
)

__all__ = [
    "build_hf_model",
    "hf_expert_modules",
    "hf_fp32_compute_tokens",
    "hf_replica_reductions",
    "hf_tied_weights",
    "hf_tp_plan",
    "patch_is_packed_sequence",
]
