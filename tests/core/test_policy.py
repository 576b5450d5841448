"""Mixed-precision policy cloning: new policies out, inputs untouched."""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdptx import get_internal_fsdp_mp_policy, mp_policy_with_param_dtype

BF16 = torch.bfloat16
FP32 = torch.float32


def full_policy() -> MixedPrecisionPolicy:
    """A policy with every field set away from its default."""
    return MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=torch.float16, output_dtype=torch.float16, cast_forward_inputs=True
    )


def test_policy_none_stays_none() -> None:
    assert mp_policy_with_param_dtype(None, BF16) is None
    assert mp_policy_with_param_dtype(None, FP32) is None


def test_bf16_clone_sets_param_dtype_and_keeps_other_fields() -> None:
    policy = MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=torch.float16, output_dtype=torch.float64, cast_forward_inputs=True
    )

    clone = mp_policy_with_param_dtype(policy, BF16)

    assert clone == MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=torch.float16, output_dtype=torch.float64, cast_forward_inputs=True
    )


def test_fp32_clone_reduces_in_fp32_and_does_not_cast_forward_inputs() -> None:
    clone = mp_policy_with_param_dtype(full_policy(), FP32)

    assert clone is not None
    assert clone.param_dtype == FP32
    assert clone.reduce_dtype == FP32
    assert clone.cast_forward_inputs is False


def test_fp32_clone_keeps_output_dtype() -> None:
    clone = mp_policy_with_param_dtype(full_policy(), FP32)

    assert clone is not None and clone.output_dtype == torch.float16


def test_bf16_clone_keeps_output_dtype() -> None:
    clone = mp_policy_with_param_dtype(full_policy(), torch.float16)

    assert clone is not None and clone.output_dtype == torch.float16


def test_clone_is_a_new_object() -> None:
    policy = full_policy()

    assert mp_policy_with_param_dtype(policy, BF16) is not policy


def test_mp_policy_with_param_dtype_does_not_mutate_its_input() -> None:
    policy = full_policy()
    before = dataclasses.astuple(policy)

    mp_policy_with_param_dtype(policy, FP32)
    mp_policy_with_param_dtype(policy, torch.float16)

    assert dataclasses.astuple(policy) == before


def test_internal_policy_clears_output_dtype_and_keeps_the_rest() -> None:
    clone = get_internal_fsdp_mp_policy(full_policy())

    assert clone == MixedPrecisionPolicy(
        param_dtype=BF16, reduce_dtype=torch.float16, output_dtype=None, cast_forward_inputs=True
    )


def test_internal_policy_of_none_is_none() -> None:
    assert get_internal_fsdp_mp_policy(None) is None


def test_get_internal_fsdp_mp_policy_does_not_mutate_its_input() -> None:
    policy = full_policy()
    before = dataclasses.astuple(policy)

    get_internal_fsdp_mp_policy(policy)

    assert dataclasses.astuple(policy) == before
    assert policy.output_dtype == torch.float16


def test_internal_fp32_policy_composes_both_clones() -> None:
    clone = get_internal_fsdp_mp_policy(mp_policy_with_param_dtype(full_policy(), FP32))

    assert clone == MixedPrecisionPolicy(
        param_dtype=FP32, reduce_dtype=FP32, output_dtype=None, cast_forward_inputs=False
    )
