"""apply_plan with torch's real ``fully_shard`` on a fake-process-group mesh:
the FSDP state it leaves behind, and that the sharded model trains."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from models import BF16, FP32, TinyDecoder, make_decoder, tokens
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx import Plan
from fsdptx.tp._marks import (
    exclude_from_tp_replica_sync,
    is_excluded_from_tp_replica_sync,
    tp_replica_reduction,
)
from fsdptx.testing import fake_mesh, record_collectives

PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh((2,), ("dp",)) as m:
        yield m


def shard(model: TinyDecoder, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None) -> Plan:
    p = fsdptx.plan(model, PIPELINE, mp_policy=mp_policy)
    fsdptx.apply_plan(p, model, mesh)
    return p


def train_step(model: TinyDecoder) -> torch.Tensor:
    out = model(tokens())
    out.float().square().mean().backward()
    return out


def test_every_planned_module_becomes_an_fsdp_module(mesh: DeviceMesh) -> None:
    model = make_decoder()
    p = shard(model, mesh)
    planned = {f for u in p.units for f in u.modules}
    fsdp = {f for f, m in model.named_modules() if isinstance(m, FSDPModule)}
    assert planned == fsdp


def test_every_parameter_becomes_a_dtensor(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_storage_dtypes_survive_sharding(mesh: DeviceMesh) -> None:
    model = make_decoder()
    before = {f: p.dtype for f, p in model.named_parameters()}
    shard(model, mesh, BF16_POLICY)
    assert {f: p.dtype for f, p in model.named_parameters()} == before


def test_cross_block_unit_is_one_param_group_for_every_block(mesh: DeviceMesh) -> None:
    model = make_decoder(3)
    shard(model, mesh)
    groups = [fully_shard.state(b.attn.sinks)._fsdp_param_group for b in model.layers]
    assert groups[0] is not None and all(g is groups[0] for g in groups)
    assert {id(fp.sharded_param) for fp in groups[0].fsdp_params} == {id(b.attn.sinks.weight) for b in model.layers}


def test_cross_block_group_is_separate_from_block_groups(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh)
    sinks_group = fully_shard.state(model.layers[0].attn.sinks)._fsdp_param_group
    block_group = fully_shard.state(model.layers[0])._fsdp_param_group
    assert sinks_group is not block_group
    assert model.layers[0].attn.sinks.weight not in {fp.sharded_param for fp in block_group.fsdp_params}


def test_each_param_group_is_storage_dtype_uniform(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh, BF16_POLICY)
    states = {id(s): s for m in model.modules() if isinstance(m, FSDPModule) for s in [fully_shard.state(m)]}
    dtypes = [{fp.sharded_param.dtype for fp in s._fsdp_param_group.fsdp_params} for s in states.values()]
    assert len(dtypes) == 6 and all(len(d) == 1 for d in dtypes)


def test_forward_and_backward_run_with_mixed_precision_disabled(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh)
    out = train_step(model)
    assert out.dtype == BF16
    grads = {f: p.grad for f, p in model.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g.full_tensor()).all()) for g in grads.values()), grads


def test_forward_and_backward_run_with_bf16_policy(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh, BF16_POLICY)
    train_step(model)
    grads = {f: p.grad for f, p in model.named_parameters()}
    assert all(g is not None for g in grads.values()), [f for f, g in grads.items() if g is None]
    # Gradients come back in each parameter's storage dtype.
    assert all(g.dtype == p.dtype for g, p in zip(grads.values(), model.parameters()))


def test_bf16_policy_output_dtype_reaches_the_caller(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, output_dtype=FP32))
    assert model(tokens()).dtype == FP32


def test_one_rank_sharded_step_matches_unsharded_step() -> None:
    """With a single dp rank every all-gather and reduce-scatter is the
    identity, so sharding must not change outputs or gradients."""
    reference = make_decoder()
    expected = train_step(reference)
    model = make_decoder()
    with fake_mesh((1,), ("dp",)) as one:
        shard(model, one)
        got = train_step(model)
        grads = {f: p.grad.full_tensor() for f, p in model.named_parameters()}
    torch.testing.assert_close(got, expected)
    for f, p in reference.named_parameters():
        torch.testing.assert_close(grads[f], p.grad, msg=f)


def test_reduction_marks_survive_sharding(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh)
    train_step(model)
    assert tp_replica_reduction(model.layers[0].gate.proj, "weight") == "sum"
    assert tp_replica_reduction(model.norm, "bias") == "mean"


def test_exclusion_mark_set_before_sharding_survives_it(mesh: DeviceMesh) -> None:
    model = make_decoder()
    exclude_from_tp_replica_sync(model.layers[1])
    shard(model, mesh)
    assert is_excluded_from_tp_replica_sync(model.layers[1])


def test_forward_all_gathers_and_issues_no_reduce_scatter(mesh: DeviceMesh) -> None:
    model = make_decoder()
    shard(model, mesh)
    with record_collectives() as calls:
        model(tokens())
    ops = [c.op for c in calls]
    assert ops and all("allgather" in op for op in ops), ops


def test_backward_reduce_scatters_once_per_unit(mesh: DeviceMesh) -> None:
    model = make_decoder()
    p = shard(model, mesh)
    out = model(tokens())
    with record_collectives() as calls:
        out.float().square().mean().backward()
    reduce_scatters = [c for c in calls if "reduce_scatter" in c.op]
    assert len(reduce_scatters) == len(p.units)
    assert {c.group for c in reduce_scatters} == {(0, 1)}


def _tp_sp_step(shape: tuple[int, ...], names: tuple[str, ...]) -> tuple[int, ...]:
    from fsdptx.presets import Decoder, DecoderConfig

    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))
    with fake_mesh(shape, names) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None, sequence_parallel=True), mesh).parallelize(model)
        out = model(torch.randint(0, 64, (2, 8)))
        local = out.to_local() if isinstance(out, DTensor) else out
        local.sum().backward()
        return tuple(local.shape)


def test_a_fake_world_does_not_inherit_dtensor_decisions_from_an_earlier_one() -> None:
    """DTensor caches sharding decisions by mesh layout: a (dp, tp) world's
    tp submesh looks like a later (dp_replicate, dp_shard, tp) world's, whose
    forward then used the destroyed world's decisions and failed, depending
    on test order."""
    assert _tp_sp_step((2, 2), ("dp", "tp")) == (2, 8, 64)
    assert _tp_sp_step((2, 1, 2), ("dp_replicate", "dp_shard", "tp")) == (2, 8, 64)
