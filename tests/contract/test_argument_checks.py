"""Every public function checks its arguments' types first and names the
argument and what it expected (TypeError/ValueError), before any change."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def small() -> Decoder:
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


def test_apply_plan_names_a_mesh_that_is_not_a_device_mesh() -> None:
    model = small()
    p = fsdptx.plan(model, fsdptx.shard_by_dtype)
    before = state_of(model)
    with pytest.raises(TypeError, match="apply_plan: mesh must be a torch DeviceMesh.*got str 'mesh'"):
        fsdptx.apply_plan(p, model, "mesh")  # type: ignore[arg-type]
    assert_unchanged(before, state_of(model))


CALLS: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "fully_shard_by_dtype(None)": (
        lambda: fsdptx.fully_shard_by_dtype(None, object(), None, None),  # type: ignore[arg-type]
        TypeError, "fully_shard_by_dtype: module must be a torch.nn.Module, got NoneType",
    ),
    "fully_shard_by_dtype(mesh='mesh')": (
        lambda: fsdptx.fully_shard_by_dtype(small(), "mesh", None, None),  # type: ignore[arg-type]
        TypeError, "fully_shard_by_dtype: mesh must be a torch DeviceMesh",
    ),
    "configure_fsdp_unused_param_reduction(None)": (
        lambda: fsdptx.configure_fsdp_unused_param_reduction(None),  # type: ignore[arg-type]
        TypeError, "configure_fsdp_unused_param_reduction: module must be a torch.nn.Module",
    ),
    "mark_tp_replica_gradient_reduction(None)": (
        lambda: fsdptx.mark_tp_replica_gradient_reduction(None, "mean"),  # type: ignore[arg-type]
        TypeError, "mark_tp_replica_gradient_reduction: module must be a torch.nn.Module, got NoneType",
    ),
    "mark_tp_replica_gradient_reduction('x')": (
        lambda: fsdptx.mark_tp_replica_gradient_reduction("x", "mean"),  # type: ignore[arg-type]
        TypeError, "mark_tp_replica_gradient_reduction: module must be a torch.nn.Module, got str",
    ),
    "mark_reduction(reductions=list)": (
        lambda: fsdptx.plan(small(), functools.partial(fsdptx.mark_reduction, reductions=["layers.*.attn_norm"])),
        TypeError, "mark_reduction: reductions must be a mapping.*got list",
    ),
    "mark_reduction(reductions='x')": (
        lambda: fsdptx.plan(small(), functools.partial(fsdptx.mark_reduction, reductions="x")),
        TypeError, "mark_reduction: reductions must be a mapping.*got str",
    ),
    "compose(None)": (
        lambda: fsdptx.compose(None),  # type: ignore[arg-type]
        TypeError, "compose: transform 0 must be callable",
    ),
    "reject_unsupported_mtp_cp_pp(pp_size='2')": (
        lambda: fsdptx.reject_unsupported_mtp_cp_pp(small(), pp_size="2"),  # type: ignore[arg-type]
        TypeError, "pp_size must be an int or None, got '2'",
    ),
    "fully_shard_across_blocks(None)": (
        lambda: fsdptx.fully_shard_across_blocks(None, ["sinks"], object(), None, None),  # type: ignore[arg-type]
        TypeError, "blocks must be a list of the blocks",
    ),
    "fully_shard_across_blocks([None])": (
        lambda: fsdptx.fully_shard_across_blocks([None], ["sinks"], object(), None, None),  # type: ignore[list-item]
        TypeError, r"blocks\[0\] is NoneType",
    ),
    "fully_shard_across_blocks([block, 3])": (
        lambda: fsdptx.fully_shard_across_blocks([small().layers[0], 3], ["sinks"], object(), None, None),  # type: ignore[list-item]
        TypeError, r"blocks\[1\] is int",
    ),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_public_function_names_the_bad_argument(call: str) -> None:
    fn, error, match = CALLS[call]
    with pytest.raises(error, match=match):
        fn()


@pytest.mark.parametrize("bad", [1.5, math.nan, None, "x", 0, True], ids=["float", "nan", "None", "str", "zero", "bool"])
def test_gradient_chunks_names_a_bad_max_bytes_at_the_call(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="gradient_chunks: max_bytes must be (a )?positive"):
        fsdptx.gradient_chunks([torch.zeros(4)], max_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["bf16", None, 3], ids=["str", "None", "int"])
def test_dtype_helpers_refuse_what_is_not_a_dtype(bad: object) -> None:
    with pytest.raises(TypeError, match="mp_policy_with_param_dtype: param_dtype must be a torch.dtype"):
        fsdptx.mp_policy_with_param_dtype(BF16, bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="gradient_reduce_dtype: dtype must be a torch.dtype"):
        fsdptx.gradient_reduce_dtype(bad)  # type: ignore[arg-type]


def test_tp_sync_with_too_small_a_budget_changes_no_gradient() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(ValueError, match="max_bytes=2 cannot hold one torch.float32 element"):
            fsdptx.synchronize_tp_replica_gradients([model], mesh, max_bytes=2)
    assert all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))


class _Holder(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(4, dtype=dtype), requires_grad=dtype.is_complex)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.value
        return (v.real if v.is_complex() else v).to(x.dtype)


class _WithOwnDtype(nn.Module):
    """A linear beside a submodule holding one non-floating (int or complex) parameter."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.layers = nn.ModuleList([_Holder(dtype)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.layers[0](x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_non_floating_parameter_keeps_its_own_dtype(dtype: torch.dtype) -> None:
    transform = functools.partial(fsdptx.shard_by_dtype, blocks=["layers.0"])
    p = fsdptx.plan(_WithOwnDtype(dtype), transform, mp_policy=BF16)
    (unit,) = [u for u in p.units if u.modules == ("layers.0",)]
    assert unit.compute_dtype in (None, dtype)
    assert unit.mp_policy is not None
    assert unit.mp_policy.param_dtype is None and unit.mp_policy.reduce_dtype is None


def test_model_with_a_complex_parameter_plans_and_applies() -> None:
    model = _WithOwnDtype(torch.complex64)
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=BF16), mesh).parallelize(model)
        assert model.layers[0].value.dtype == torch.complex64
        assert model(torch.ones(2, 4)).shape == (2, 4)
