"""Mixed-precision policy cloning. Policies are frozen; these never mutate input.

``None`` means "mixed precision disabled" throughout fsdptx.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["get_internal_fsdp_mp_policy", "mp_policy_with_param_dtype", "primitive_policy"]


def mp_policy_with_param_dtype(
    mp_policy: MixedPrecisionPolicy | None, param_dtype: torch.dtype
) -> MixedPrecisionPolicy | None:
    """Clone ``mp_policy`` so its unit computes in ``param_dtype``.

    For fp32 the clone also reduces in fp32 (an intrinsically-fp32 parameter's
    gradient must not round-trip through bf16) and does not cast forward
    inputs: an fp32 module casts its own inputs, and a cast at a nested FSDP
    boundary would run again in an activation-checkpoint recompute and make it
    disagree with the original forward. ``output_dtype`` is kept; callers that
    build internal units clear it with :func:`get_internal_fsdp_mp_policy`.
    """
    if mp_policy is None:
        return None
    if param_dtype == torch.float32:
        return dataclasses.replace(
            mp_policy,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            cast_forward_inputs=False,
        )
    return dataclasses.replace(mp_policy, param_dtype=param_dtype)


def get_internal_fsdp_mp_policy(
    mp_policy: MixedPrecisionPolicy | None,
) -> MixedPrecisionPolicy | None:
    """Clone ``mp_policy`` without an external ``output_dtype``.

    Units nested inside an enclosing module's forward (dtype-specific children,
    cross-block holders) may feed an unwrapped sibling before any other cast;
    they return their natural dtype and only the enclosing boundary applies
    the caller's ``output_dtype``.
    """
    if mp_policy is None:
        return None
    return dataclasses.replace(mp_policy, output_dtype=None)


def primitive_policy(mp_policy: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    """The object handed to ``fully_shard``: it wants a policy, never ``None``
    (``None`` is accepted at construction and fails at the first forward)."""
    return MixedPrecisionPolicy() if mp_policy is None else mp_policy
