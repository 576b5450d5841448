"""Mixed-precision policy cloning. Policies are frozen; these never mutate input.

``None`` means "mixed precision disabled" throughout fsdptx.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from ._args import require_dtype, require_mp_policy

__all__ = [
    "check_policy_dtypes",
    "get_internal_fsdp_mp_policy",
    "keep_storage_policy",
    "mp_policy_with_param_dtype",
    "policy_dtype_problems",
    "primitive_policy",
]


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
    ``param_dtype`` must be a floating ``torch.dtype``; checked even when
    ``mp_policy`` is ``None``, so a wrong call fails on every path.

    Args:
        mp_policy: the policy to clone; ``None`` (mixed precision disabled)
            stays ``None``.
        param_dtype: the floating dtype the unit computes in.

    Returns:
        A new policy (the input is never mutated), or ``None``.

    Raises:
        TypeError: ``param_dtype`` is not a dtype or ``mp_policy`` is not a
            ``MixedPrecisionPolicy``.
        ValueError: ``param_dtype`` is not a floating dtype.

    Example::

        fp32 = fsdptx.mp_policy_with_param_dtype(policy, torch.float32)
        assert fp32.reduce_dtype is torch.float32 and not fp32.cast_forward_inputs
    """
    require_dtype(param_dtype, "param_dtype", "mp_policy_with_param_dtype")
    if not param_dtype.is_floating_point:
        raise ValueError(f"mp_policy_with_param_dtype: param_dtype must be a floating dtype, got {param_dtype}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy_with_param_dtype: mp_policy must be a MixedPrecisionPolicy or None, got {mp_policy!r}")
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


def keep_storage_policy(mp_policy: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
    """Clone ``mp_policy`` so its unit casts nothing: parameters compute
    and gradients reduce in their storage dtype. For units of integer, bool
    or complex parameters, which a floating ``param_dtype`` would truncate
    (or strip of the imaginary part)."""
    if mp_policy is None:
        return None
    return dataclasses.replace(mp_policy, param_dtype=None, reduce_dtype=None)


def get_internal_fsdp_mp_policy(
    mp_policy: MixedPrecisionPolicy | None,
) -> MixedPrecisionPolicy | None:
    """Clone ``mp_policy`` without an external ``output_dtype``.

    Units nested inside an enclosing module's forward (dtype-specific children,
    cross-block holders) may feed an unwrapped sibling before any other cast;
    they return their natural dtype and only the enclosing boundary applies
    the caller's ``output_dtype``.

    Args:
        mp_policy: the caller's policy; ``None`` stays ``None``.

    Returns:
        A new policy with ``output_dtype=None`` (the input is never mutated).

    Example::

        internal = fsdptx.get_internal_fsdp_mp_policy(policy)
        fully_shard(block.attn.sinks_holder, mesh=mesh, mp_policy=internal)
    """
    policy = require_mp_policy(mp_policy, "mp_policy", "get_internal_fsdp_mp_policy")
    if policy is None:
        return None
    return dataclasses.replace(policy, output_dtype=None)


def primitive_policy(mp_policy: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy:
    """The object handed to ``fully_shard``: it wants a policy, never ``None``
    (``None`` is accepted at construction and fails at the first forward)."""
    return MixedPrecisionPolicy() if mp_policy is None else mp_policy


def policy_dtype_problems(policy: MixedPrecisionPolicy | None, where: str) -> list[str]:
    """One problem per ``param_dtype``, ``reduce_dtype`` or ``output_dtype``
    of ``policy`` that is neither ``None`` nor a floating dtype (a string
    such as ``"bf16"`` included), and for a ``cast_forward_inputs`` that is
    not a bool: FSDP2 would cast parameters, gradients or outputs to it,
    which no training wants and which fails (or silently truncates) long
    after construction."""
    if policy is None:
        return []
    problems = [
        f"{where}: mp_policy.{name} must be a floating dtype (torch.bfloat16, torch.float16, "
        f"torch.float32) or None, got {value!r}"
        for name in ("param_dtype", "reduce_dtype", "output_dtype")
        if (value := getattr(policy, name)) is not None
        and not (isinstance(value, torch.dtype) and value.is_floating_point)
    ]
    if not isinstance(policy.cast_forward_inputs, bool):
        problems.append(f"{where}: mp_policy.cast_forward_inputs must be a bool, got {policy.cast_forward_inputs!r}")
    return problems


def check_policy_dtypes(policy: MixedPrecisionPolicy | None, where: str) -> None:
    """Refuse what :func:`policy_dtype_problems` finds, with its first problem."""
    problems = policy_dtype_problems(policy, where)
    if problems:
        raise ValueError(problems[0])
