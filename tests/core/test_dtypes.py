"""Dtype resolution (compute dtype precedence), grouping, and gradient reduce dtype."""

from __future__ import annotations

import pytest
import torch
from models import container
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdptx import gradient_reduce_dtype, group_params_by_dtype, make_compute_dtype_fn

BF16 = torch.bfloat16
FP32 = torch.float32
BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


def param(dtype: torch.dtype, *, hint: torch.dtype | None = None) -> nn.Parameter:
    """A small parameter of ``dtype``, optionally carrying ``_hf_compute_dtype``."""
    p = nn.Parameter(torch.zeros(2, dtype=dtype), requires_grad=dtype.is_floating_point)
    if hint is not None:
        p._hf_compute_dtype = hint  # type: ignore[attr-defined]
    return p


def holder(**params: nn.Parameter) -> nn.Module:
    """A module with the given direct parameters, in argument order."""
    m = nn.Module()
    for name, p in params.items():
        m.register_parameter(name, p)
    return m


# --- make_compute_dtype_fn: one test per precedence rule ------------------------------


def test_non_floating_tensor_keeps_its_storage_dtype() -> None:
    m = nn.Module()
    m.register_buffer("A_log_steps", torch.zeros(2, dtype=torch.int64))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("A_log",))

    assert resolve(m.A_log_steps) == torch.int64


def test_name_containing_a_pinned_token_computes_in_fp32_even_for_bf16_storage() -> None:
    m = container(mixer=holder(A_log=param(BF16), weight=param(BF16)))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("A_log",))

    assert resolve(m.mixer.A_log) == FP32
    assert resolve(m.mixer.weight) == BF16


def test_pinned_token_matches_any_part_of_the_fqn() -> None:
    m = container(layers=nn.ModuleList([container(router=holder(weight=param(FP32)))]))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("router",))

    assert resolve(m.layers[0].router.weight) == FP32


def test_pinned_token_wins_over_hf_compute_dtype_hint() -> None:
    m = holder(sinks=param(FP32, hint=BF16))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("sinks",))

    assert resolve(m.sinks) == FP32


def test_hf_compute_dtype_attribute_is_used_when_no_token_matches() -> None:
    m = holder(dt_bias=param(FP32, hint=FP32), weight=param(FP32))
    resolve = make_compute_dtype_fn(m, BF16_POLICY)

    assert resolve(m.dt_bias) == FP32
    assert resolve(m.weight) == BF16


def test_hf_compute_dtype_attribute_applies_to_bf16_storage_too() -> None:
    m = holder(w=param(BF16, hint=torch.float16))
    resolve = make_compute_dtype_fn(m, None)

    assert resolve(m.w) == torch.float16


def test_non_floating_hf_compute_dtype_hint_is_ignored() -> None:
    m = holder(w=param(FP32, hint=torch.int8))
    resolve = make_compute_dtype_fn(m, BF16_POLICY)

    assert resolve(m.w) == BF16


def test_fp32_storage_under_bf16_policy_computes_in_bf16() -> None:
    m = holder(w=param(FP32))

    assert make_compute_dtype_fn(m, BF16_POLICY)(m.w) == BF16


def test_fp32_storage_under_fp16_policy_computes_in_fp16() -> None:
    m = holder(w=param(FP32))

    assert make_compute_dtype_fn(m, MixedPrecisionPolicy(param_dtype=torch.float16))(m.w) == torch.float16


def test_fp32_storage_with_policy_none_stays_fp32() -> None:
    m = holder(w=param(FP32))

    assert make_compute_dtype_fn(m, None)(m.w) == FP32


def test_fp32_storage_under_policy_without_param_dtype_stays_fp32() -> None:
    m = holder(w=param(FP32))

    assert make_compute_dtype_fn(m, MixedPrecisionPolicy(reduce_dtype=FP32))(m.w) == FP32


def test_fp32_storage_under_higher_precision_policy_stays_fp32() -> None:
    m = holder(w=param(FP32))

    assert make_compute_dtype_fn(m, MixedPrecisionPolicy(param_dtype=torch.float64))(m.w) == FP32


def test_bf16_storage_stays_bf16_under_bf16_policy() -> None:
    m = holder(w=param(BF16))

    assert make_compute_dtype_fn(m, BF16_POLICY)(m.w) == BF16


def test_bf16_storage_stays_bf16_with_policy_none() -> None:
    m = holder(w=param(BF16))

    assert make_compute_dtype_fn(m, None)(m.w) == BF16


@pytest.mark.parametrize("pinned_name", ["lm_head", "embed_tokens"])
def test_tied_tensor_is_pinned_via_any_of_its_names(pinned_name: str) -> None:
    shared = param(FP32)
    m = container(embed_tokens=holder(weight=shared), lm_head=holder(weight=shared))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=(pinned_name,))

    assert resolve(shared) == FP32


def test_buffer_names_are_matched_against_pinned_tokens() -> None:
    m = nn.Module()
    m.register_buffer("inv_freq", torch.zeros(2, dtype=BF16))
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("inv_freq",))

    assert resolve(m.inv_freq) == FP32


def test_tensor_outside_the_module_resolves_without_names() -> None:
    m = holder(A_log=param(FP32))
    stranger = param(FP32)
    resolve = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("A_log",))

    assert resolve(stranger) == BF16


def test_ignored_params_are_not_pinned_by_name() -> None:
    m = holder(A_log=param(FP32))
    resolve = make_compute_dtype_fn(
        m, BF16_POLICY, fp32_compute_module_names=("A_log",), ignored_params={m.A_log}
    )

    assert resolve(m.A_log) == BF16


# --- group_params_by_dtype ------------------------------------------------------------


def test_params_are_grouped_by_storage_dtype_by_default() -> None:
    m = holder(a=param(BF16), b=param(FP32), c=param(BF16))

    groups = group_params_by_dtype(m)

    assert list(groups) == [BF16, FP32]
    assert groups[BF16] == [m.a, m.c]
    assert groups[FP32] == [m.b]


def test_groups_are_keyed_by_a_custom_key() -> None:
    m = holder(a=param(FP32), A_log=param(FP32))
    compute = make_compute_dtype_fn(m, BF16_POLICY, fp32_compute_module_names=("A_log",))

    groups = group_params_by_dtype(m, dtype_of=lambda t: (t.dtype, compute(t)))

    assert groups == {(FP32, BF16): [m.a], (FP32, FP32): [m.A_log]}


def test_ignored_params_are_left_out_of_every_group() -> None:
    m = holder(a=param(BF16), b=param(FP32))

    groups = group_params_by_dtype(m, ignored_params={m.b})

    assert groups == {BF16: [m.a]}


def test_tied_param_is_grouped_once() -> None:
    shared = param(BF16)
    m = container(x=holder(w=shared), y=holder(w=shared))

    groups = group_params_by_dtype(m)

    assert len(groups[BF16]) == 1 and groups[BF16][0] is shared


def test_buffers_are_not_grouped() -> None:
    m = holder(a=param(BF16))
    m.register_buffer("b", torch.zeros(1, dtype=FP32))

    assert group_params_by_dtype(m) == {BF16: [m.a]}


def test_module_without_params_has_no_groups() -> None:
    assert group_params_by_dtype(nn.Module()) == {}


# --- gradient_reduce_dtype --------------------------------------------------------------

FLOAT8_KINDS = [
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FLOAT8_KINDS], ids=str)
def test_low_precision_floats_reduce_in_fp32(dtype: torch.dtype) -> None:
    assert gradient_reduce_dtype(dtype) == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32], ids=str)
def test_other_dtypes_reduce_in_themselves(dtype: torch.dtype) -> None:
    assert gradient_reduce_dtype(dtype) == dtype

