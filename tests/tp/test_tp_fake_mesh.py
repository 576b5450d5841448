"""TP-replica synchronization on fake process groups (one process, no GPU).

A fake collective does not communicate: an all-reduce returns the local input
and a broadcast leaves the tensor as it is. What these tests can observe is
therefore *which* collectives are issued (op, group, shapes, dtypes, count),
*which* tensors go into them, and the local arithmetic around them: a mean is
the all-reduced sum divided by the TP size, so on a fake group it shows up as
``grad / tp_size`` and a sum as ``grad`` unchanged. The values that real peers
exchange are checked in ``test_tp_gloo.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

from fsdptx import (
    broadcast_tp_replicas,
    exclude_from_tp_replica_sync,
    gradient_chunks,
    is_tp_replicated,
    iter_unique_named_parameters,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)
from fsdptx.testing import Collective, fake_mesh, record_collectives

BF16 = torch.bfloat16
FP32 = torch.float32


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def dp_tp_mesh() -> Iterator[DeviceMesh]:
    """A fake (dp=2, tp=2) mesh seen from rank 1: TP group (0, 1), DP group (1, 3)."""
    with fake_mesh((2, 2), ("dp", "tp"), rank=1) as mesh:
        yield mesh


def _ep_mesh(ep_name: str) -> DeviceMesh:
    """A (dp=2, <ep_name>=2) mesh over the same 4 ranks as a (dp=2, tp=2) mesh:
    its second axis spans exactly the TP groups (0, 1) and (2, 3)."""
    return DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp", ep_name))


def _set_grads(model: nn.Module, value_of: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    for fqn, p in iter_unique_named_parameters(model):
        p.grad = value_of(fqn, p)


def _known_grad(fqn: str, p: torch.Tensor) -> torch.Tensor:
    """A distinct, exactly halvable value per parameter (integers plus 0.5)."""
    base = float(sum(map(ord, fqn)) % 17 + 1)
    if isinstance(p, DTensor):
        return torch.full_like(p, base)
    return (torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) + base + 0.5).to(p.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grad_snapshot(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        fqn: None if p.grad is None else _local(p.grad).detach().clone()
        for fqn, p in iter_unique_named_parameters(model)
    }


def _float_reductions(calls: list[Collective]) -> list[Collective]:
    return [c for c in calls if c.dtypes and c.dtypes[0].is_floating_point]


def _is_agreement(call: Collective) -> bool:
    """The small int64 all-to-all every sync and broadcast starts with: four
    values to and from each rank."""
    size = 4 * len(call.group)
    return (
        call.op == "alltoall_base_"
        and call.dtypes == (torch.int64, torch.int64)
        and call.shapes == ((size,), (size,))
    )


class _Owner(nn.Module):
    """Two linears and a buffer: a stand-in for an ordinary replicated module."""

    def __init__(self, dtype: torch.dtype = FP32) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, dtype=dtype)
        self.b = nn.Linear(4, 2, bias=False, dtype=dtype)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


class _Model(nn.Module):
    """``mean_part`` (unmarked), ``sum_part`` (to be marked "sum") and
    ``owned`` (to be excluded; its child holds a parameter and a
    non-persistent buffer two levels below the excluded module)."""

    def __init__(self) -> None:
        super().__init__()
        self.mean_part = _Owner()
        self.sum_part = _Owner(BF16)
        self.owned = nn.Module()
        self.owned.inner = _Owner()
        self.owned.inner.register_buffer("cache", torch.ones(5), persistent=False)


def _marked_model() -> _Model:
    model = _Model()
    mark_tp_replica_gradient_reduction(model.sum_part.a, "sum")
    mark_tp_replica_gradient_reduction(model.sum_part.b, "sum")
    exclude_from_tp_replica_sync(model.owned)
    return model


# ------------------------------------------------------------- is_tp_replicated


def test_plain_tensor_is_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    assert is_tp_replicated(torch.ones(3), (0, 1), 1, "tp") is True


def test_dtensor_replicated_on_dp_and_tp_is_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    t = distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Replicate(), Replicate()])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is True


def test_dtensor_sharded_on_dp_and_replicated_on_tp_is_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    t = distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Shard(0), Replicate()])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is True


def test_dtensor_sharded_on_tp_is_not_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    t = distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Replicate(), Shard(0)])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is False


def test_dtensor_partial_on_tp_is_not_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    local = torch.ones(4, 4)
    t = DTensor.from_local(local, dp_tp_mesh, [Replicate(), Partial()], run_check=False)
    assert is_tp_replicated(t, (0, 1), 1, "tp") is False


def test_dtensor_sharded_on_tp_submesh_is_not_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    t = distribute_tensor(torch.ones(4, 4), dp_tp_mesh["tp"], [Shard(0)])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is False


def test_dtensor_sharded_on_dp_submesh_is_tp_replicated(dp_tp_mesh: DeviceMesh) -> None:
    """Its mesh (ranks 1, 3) holds no TP peer of rank 1: each TP rank keeps its own copy."""
    t = distribute_tensor(torch.ones(4, 4), dp_tp_mesh["dp"], [Shard(0)])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is True


@pytest.mark.parametrize("ep_name", ["ep", "ep_shard"])
def test_dtensor_sharded_on_axis_folding_tp_ranks_is_not_tp_replicated(
    dp_tp_mesh: DeviceMesh, ep_name: str
) -> None:
    t = distribute_tensor(torch.ones(4, 4), _ep_mesh(ep_name), [Replicate(), Shard(0)])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is False


@pytest.mark.parametrize("ep_name", ["ep", "ep_shard"])
def test_dtensor_replicated_on_axis_folding_tp_ranks_is_tp_replicated(dp_tp_mesh: DeviceMesh, ep_name: str) -> None:
    """Control for the test above: Shard on the other axis, Replicate where the TP ranks are."""
    t = distribute_tensor(torch.ones(4, 4), _ep_mesh(ep_name), [Shard(0), Replicate()])
    assert is_tp_replicated(t, (0, 1), 1, "tp") is True


# ---------------------------------------------------- nothing to synchronize


_NO_TP_MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]] | None] = {
    "no-mesh": None,
    "dp-only": ((4,), ("dp",)),
    "tp-size-1": ((4, 1), ("dp", "tp")),
}


@pytest.mark.parametrize("case", list(_NO_TP_MESHES))
def test_sync_without_nontrivial_tp_axis_returns_zero_without_collectives(case: str) -> None:
    model = _Model()
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    layout = _NO_TP_MESHES[case]
    with fake_mesh(*(layout or ((2,), ("dp",)))) as mesh, record_collectives() as calls:
        count = synchronize_tp_replica_gradients([model], mesh if layout else None)
    assert (count, calls) == (0, [])
    after = _grad_snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(_NO_TP_MESHES))
def test_broadcast_without_nontrivial_tp_axis_returns_zero_without_collectives(case: str) -> None:
    model = _Model()
    layout = _NO_TP_MESHES[case]
    with fake_mesh(*(layout or ((2,), ("dp",)))) as mesh, record_collectives() as calls:
        count = broadcast_tp_replicas([model], mesh if layout else None)
    assert (count, calls) == (0, [])


def test_sync_with_other_axis_name_uses_that_axis(dp_tp_mesh: DeviceMesh) -> None:
    """``tp_axis_name`` selects the group: naming "dp" reduces over DP peers (1, 3)."""
    model = _Owner()
    _set_grads(model, _known_grad)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, dp_tp_mesh, tp_axis_name="dp")
    assert calls and {c.group for c in calls} == {(1, 3)}


def test_each_call_reduces_over_the_axis_it_names(dp_tp_mesh: DeviceMesh) -> None:
    """The model remembers its last TP context; naming another axis (or
    passing another mesh) is not answered from that memory."""
    model = _Owner()
    groups = []
    for axis in ("tp", "tp", "tp", "dp", "tp"):
        _set_grads(model, _known_grad)
        with record_collectives() as calls:
            synchronize_tp_replica_gradients(model, dp_tp_mesh, tp_axis_name=axis)
        groups.append({c.group for c in calls})
    assert groups == [{(0, 1)}] * 3 + [{(1, 3)}, {(0, 1)}]


def test_a_call_with_another_mesh_reduces_over_that_mesh(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner()
    for _ in range(3):
        _set_grads(model, _known_grad)
        synchronize_tp_replica_gradients(model, dp_tp_mesh)
    transposed = DeviceMesh("cpu", torch.arange(4).reshape(2, 2).T, mesh_dim_names=("dp", "tp"))
    _set_grads(model, _known_grad)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, transposed)
    assert {c.group for c in calls} == {(1, 3)}


# ----------------------------------------------------------- the mean/sum path


def test_mean_gradient_is_divided_by_tp_size_on_fake_group(dp_tp_mesh: DeviceMesh) -> None:
    model = _marked_model()
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    for fqn in ("mean_part.a.weight", "mean_part.a.bias", "mean_part.b.weight"):
        assert torch.equal(model.get_parameter(fqn).grad, before[fqn] / 2), fqn


def test_mean_gradient_is_divided_by_four_on_tp4_fake_group() -> None:
    model = _Owner()
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    with fake_mesh((4,), ("tp",), rank=2) as mesh:
        synchronize_tp_replica_gradients(model, mesh)
    for fqn, p in model.named_parameters():
        assert torch.equal(p.grad, before[fqn] / 4), fqn


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so -0.0, NaN and subnormals compare exactly."""
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


# Values where scaling by a reciprocal could differ from dividing: random
# mantissas, subnormals, the extremes, signed zeros, infinities and NaN.
def _awkward(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    special = [info.tiny / 3, -info.tiny / 5, info.tiny, info.max, -info.max, 0.0, -0.0, float("inf"),
               float("-inf"), float("nan")]
    random = torch.randn(4000, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 1e3
    return torch.cat([torch.tensor(special, dtype=torch.float64), random]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_mean_over_a_power_of_two_is_the_quotient_bit_for_bit(tp: int, dtype: torch.dtype) -> None:
    p = nn.Parameter(torch.zeros(4010, dtype=dtype))
    p.grad = _awkward(dtype)
    want = p.grad / tp
    with fake_mesh((tp,), ("tp",)) as mesh:
        synchronize_tp_replica_gradients(nn.ParameterList([p]), mesh)
    assert torch.equal(_bits(p.grad), _bits(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_over_three_ranks_is_the_quotient_not_a_reciprocal_product(dtype: torch.dtype) -> None:
    p = nn.Parameter(torch.zeros(4010, dtype=dtype))
    p.grad = _awkward(dtype)
    want = p.grad / 3
    assert not torch.equal(_bits(p.grad * (1 / 3)), _bits(want))  # the data tells the two apart
    with fake_mesh((3,), ("tp",)) as mesh:
        synchronize_tp_replica_gradients(nn.ParameterList([p]), mesh)
    assert torch.equal(_bits(p.grad), _bits(want))


def test_sum_marked_gradient_is_not_divided_on_fake_group(dp_tp_mesh: DeviceMesh) -> None:
    model = _marked_model()
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    for fqn in ("sum_part.a.weight", "sum_part.a.bias", "sum_part.b.weight"):
        assert torch.equal(model.get_parameter(fqn).grad, before[fqn]), fqn


def test_bf16_gradient_keeps_dtype_after_sync(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner(BF16)
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients(model, dp_tp_mesh)
    for fqn, p in model.named_parameters():
        assert p.grad.dtype == BF16
        assert torch.equal(p.grad, (before[fqn].float() / 2).to(BF16)), fqn  # type: ignore[union-attr]


def test_excluded_subtree_gradients_are_untouched_by_sync(dp_tp_mesh: DeviceMesh) -> None:
    model = _marked_model()
    _set_grads(model, _known_grad)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    owned = [fqn for fqn in before if fqn.startswith("owned.")]
    assert owned == ["owned.inner.a.bias", "owned.inner.a.weight", "owned.inner.b.weight"]
    for fqn in owned:
        assert torch.equal(model.get_parameter(fqn).grad, before[fqn]), fqn


def test_sync_counts_each_synchronized_gradient_once(dp_tp_mesh: DeviceMesh) -> None:
    model = _marked_model()
    _set_grads(model, _known_grad)
    model.mean_part.b.weight.grad = None
    # 3 + 3 replicated params, one without a grad; the 3 excluded ones are not counted
    assert synchronize_tp_replica_gradients([model], dp_tp_mesh) == 5


def test_tied_parameter_is_reduced_and_counted_once(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner()
    model.tied = nn.Linear(4, 4)
    model.tied.weight = model.a.weight
    _set_grads(model, _known_grad)
    before = _local(model.a.weight.grad).clone()
    count = synchronize_tp_replica_gradients(model, dp_tp_mesh)
    assert count == 4  # a.weight (= tied.weight), a.bias, b.weight, tied.bias
    assert torch.equal(model.a.weight.grad, before / 2)  # divided once, not twice


def test_sync_leaves_tp_sharded_dtensor_gradient_untouched(dp_tp_mesh: DeviceMesh) -> None:
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Replicate(), Shard(0)]))
    # from_local, not distribute_tensor: a fake scatter would leave the shard uninitialized
    model.w.grad = DTensor.from_local(torch.full((2, 4), 3.0), dp_tp_mesh, [Replicate(), Shard(0)], run_check=False)
    with record_collectives() as calls:
        count = synchronize_tp_replica_gradients(model, dp_tp_mesh)
    assert count == 0
    assert _float_reductions(calls) == []
    assert torch.equal(model.w.grad.to_local(), torch.full((2, 4), 3.0))


def test_sync_leaves_tp_partial_gradient_of_replicated_param_untouched(dp_tp_mesh: DeviceMesh) -> None:
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.ones(4), dp_tp_mesh, [Replicate(), Replicate()]))
    model.w.grad = DTensor.from_local(torch.full((4,), 3.0), dp_tp_mesh, [Replicate(), Partial()], run_check=False)
    assert synchronize_tp_replica_gradients(model, dp_tp_mesh) == 0
    assert model.w.grad.placements == (Replicate(), Partial())
    assert torch.equal(model.w.grad.to_local(), torch.full((4,), 3.0))


def test_replicate_dtensor_on_the_tp_mesh_is_left_to_dtensor_with_no_collective(dp_tp_mesh: DeviceMesh) -> None:
    """A parameter ``Replicate`` on the tp dim whose gradient arrives
    ``Replicate`` there (DTensor reduced it, as it does an SP norm's) is not
    reduced again; with nothing else to reduce, not even the agreement runs."""
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.ones(4), dp_tp_mesh, [Shard(0), Replicate()]))
    model.w.grad = DTensor.from_local(torch.full((2,), 3.0), dp_tp_mesh, [Shard(0), Replicate()], run_check=False)
    with record_collectives() as calls:
        count = synchronize_tp_replica_gradients(model, dp_tp_mesh)
    assert (count, calls) == (0, [])
    assert torch.equal(model.w.grad.to_local(), torch.full((2,), 3.0))


def test_a_plain_replica_beside_a_tp_mesh_dtensor_is_the_only_one_reduced(dp_tp_mesh: DeviceMesh) -> None:
    model = nn.Module()
    model.norm = nn.Parameter(distribute_tensor(torch.ones(4), dp_tp_mesh, [Replicate(), Replicate()]))
    model.norm.grad = DTensor.from_local(torch.full((4,), 3.0), dp_tp_mesh, [Replicate(), Replicate()], run_check=False)
    model.plain = nn.Parameter(torch.ones(6))
    model.plain.grad = torch.full((6,), 5.0)
    with record_collectives() as calls:
        count = synchronize_tp_replica_gradients(model, dp_tp_mesh)
    assert count == 1
    assert _is_agreement(calls[0])
    assert [(c.op, c.shapes) for c in _float_reductions(calls)] == [("allreduce_", ((6,),))]  # the plain one only
    assert torch.equal(model.plain.grad, torch.full((6,), 2.5))  # the fake group's sum is the local value
    assert torch.equal(model.norm.grad.to_local(), torch.full((4,), 3.0))


def test_a_dtensor_replicated_across_tp_peers_under_another_dim_name_is_still_reduced() -> None:
    """Only the TP dim's ``Replicate`` is DTensor's promise about the TP
    peers; a mesh replicating across them under another name (an FSDP unit
    on a mesh spanning them) gets no reduction over them from DTensor."""
    with fake_mesh((2, 2), ("dp", "tp"), rank=1) as mesh:
        model = nn.Module()
        model.w = nn.Parameter(distribute_tensor(torch.ones(4), _ep_mesh("rep"), [Replicate(), Replicate()]))
        model.w.grad = DTensor.from_local(torch.full((4,), 3.0), _ep_mesh("rep"), [Replicate(), Replicate()], run_check=False)
        assert synchronize_tp_replica_gradients(model, mesh) == 1
    assert torch.equal(model.w.grad.to_local(), torch.full((4,), 1.5))


# ------------------------------------------------------------ under fully_shard


def _sharded_marked_model(mesh: DeviceMesh) -> _Model:
    """Marks and exclusion set first, then every module wrapped by real FSDP2 on
    the DP submesh, which replaces each parameter with a DTensor parameter."""
    model = _marked_model()
    for module in (model.mean_part, model.sum_part, model.owned.inner, model):
        fully_shard(module, mesh=mesh["dp"])
    assert all(isinstance(p, DTensor) for p in model.parameters())
    _set_grads(model, _known_grad)
    return model


def test_sum_mark_survives_fully_shard(dp_tp_mesh: DeviceMesh) -> None:
    model = _sharded_marked_model(dp_tp_mesh)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    for fqn in ("sum_part.a.weight", "sum_part.a.bias", "sum_part.b.weight"):
        assert torch.equal(_local(model.get_parameter(fqn).grad), before[fqn]), fqn


def test_unmarked_gradient_is_mean_reduced_under_fully_shard(dp_tp_mesh: DeviceMesh) -> None:
    model = _sharded_marked_model(dp_tp_mesh)
    before = _grad_snapshot(model)
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    for fqn in ("mean_part.a.weight", "mean_part.a.bias", "mean_part.b.weight"):
        assert torch.equal(_local(model.get_parameter(fqn).grad), before[fqn] / 2), fqn


def test_exclusion_survives_fully_shard(dp_tp_mesh: DeviceMesh) -> None:
    model = _sharded_marked_model(dp_tp_mesh)
    before = _grad_snapshot(model)
    count = synchronize_tp_replica_gradients([model], dp_tp_mesh)
    assert count == 6
    for fqn in ("owned.inner.a.weight", "owned.inner.a.bias", "owned.inner.b.weight"):
        assert torch.equal(_local(model.get_parameter(fqn).grad), before[fqn]), fqn


def test_dtensor_gradients_keep_type_shape_and_placements(dp_tp_mesh: DeviceMesh) -> None:
    model = _sharded_marked_model(dp_tp_mesh)
    specs = {
        fqn: (p.grad.shape, p.grad.placements, p.grad.device_mesh, p.grad.to_local().shape)
        for fqn, p in model.named_parameters()
    }
    synchronize_tp_replica_gradients([model], dp_tp_mesh)
    for fqn, p in model.named_parameters():
        assert isinstance(p.grad, DTensor), fqn
        assert (p.grad.shape, p.grad.placements, p.grad.device_mesh, p.grad.to_local().shape) == specs[fqn]


# --------------------------------------------------------------- broadcast


def test_broadcast_skips_excluded_subtree_params_and_buffers(dp_tp_mesh: DeviceMesh) -> None:
    model = _marked_model()
    with record_collectives() as calls:
        count = broadcast_tp_replicas([model], dp_tp_mesh)
    included = [
        t for name, t in [*model.named_parameters(), *model.named_buffers()] if not name.startswith("owned.")
    ]
    assert count == len(included) == 8  # 3 + 3 params, 2 int64 buffers
    assert _is_agreement(calls[0])
    assert all(c.op.startswith("broadcast") and c.group == (0, 1) for c in calls[1:])
    assert sum(c.shapes[0][0] for c in calls[1:]) == sum(t.numel() for t in included)


def test_broadcast_includes_int64_and_non_persistent_buffers(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner()
    model.register_buffer("rope", torch.ones(7), persistent=False)
    with record_collectives() as calls:
        count = broadcast_tp_replicas(model, dp_tp_mesh)
    assert count == 5  # a.weight, a.bias, b.weight, steps, rope
    assert _is_agreement(calls[0])
    broadcasts = calls[1:]
    assert {c.dtypes[0] for c in broadcasts} == {FP32, torch.int64}
    by_dtype = {d: sum(c.shapes[0][0] for c in broadcasts if c.dtypes[0] == d) for d in (FP32, torch.int64)}
    assert by_dtype == {FP32: 16 + 4 + 8 + 7, torch.int64: 3}


def test_broadcast_skips_tp_sharded_dtensor(dp_tp_mesh: DeviceMesh) -> None:
    model = nn.Module()
    model.shard = nn.Parameter(distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Replicate(), Shard(0)]))
    model.copy = nn.Parameter(distribute_tensor(torch.ones(4, 4), dp_tp_mesh, [Shard(0), Replicate()]))
    with record_collectives() as calls:
        count = broadcast_tp_replicas(model, dp_tp_mesh)
    assert count == 1
    assert [c.shapes for c in calls[1:]] == [((8,),)]  # copy's rank-local (2, 4) storage only


# ------------------------------------------------------- collective structure


def _many_param_model() -> nn.Module:
    """12 parameters: fp32 and bf16, mean and sum, varied sizes."""
    model = nn.Module()
    for i in range(6):
        dtype = BF16 if i % 2 else FP32
        layer = nn.Linear(3 + i, 2 + i % 3, dtype=dtype)
        if i % 3 == 0:
            mark_tp_replica_gradient_reduction(layer, "sum")
        model.add_module(f"l{i}", layer)
    return model


@pytest.mark.parametrize("max_bytes", [64, 200, 1000])
def test_float_reductions_match_gradient_chunks_of_all_grads(dp_tp_mesh: DeviceMesh, max_bytes: int) -> None:
    """One fp32 buffer per chunk carries fp32 and bf16, mean and sum grads
    together; 4 bytes of the budget hold the mean's divisor, so the buffer
    and the divisor together stay within ``max_bytes``."""
    model = _many_param_model()
    _set_grads(model, _known_grad)
    grads = [p.grad for _fqn, p in iter_unique_named_parameters(model)]
    expected = len(list(gradient_chunks(grads, max_bytes - 4)))  # type: ignore[arg-type]
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, dp_tp_mesh, max_bytes=max_bytes)
    floats = _float_reductions(calls)
    assert len(floats) == expected
    assert all(c.op == "allreduce_" and c.dtypes == (FP32,) and c.group == (0, 1) for c in floats)
    assert all((c.shapes[0][0] + 1) * 4 <= max_bytes for c in floats)


def test_float_reductions_are_fewer_than_parameters(dp_tp_mesh: DeviceMesh) -> None:
    model = _many_param_model()
    _set_grads(model, _known_grad)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, dp_tp_mesh, max_bytes=200)
    assert 1 < len(_float_reductions(calls)) < len(list(model.parameters()))


def test_one_small_int64_all_to_all_precedes_the_float_reductions(dp_tp_mesh: DeviceMesh) -> None:
    model = _many_param_model()
    _set_grads(model, _known_grad)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, dp_tp_mesh, max_bytes=200)
    ints = [i for i, c in enumerate(calls) if torch.int64 in c.dtypes]
    assert ints == [0]
    assert _is_agreement(calls[0]) and calls[0].group == (0, 1)
    assert len(calls) == 1 + len(_float_reductions(calls))


def test_gradient_larger_than_budget_is_reduced_in_bounded_slices(dp_tp_mesh: DeviceMesh) -> None:
    model = nn.Module()
    model.big = nn.Parameter(torch.zeros(10, 10))
    model.big.grad = torch.arange(100, dtype=FP32).reshape(10, 10)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, dp_tp_mesh, max_bytes=48)
    floats = _float_reductions(calls)
    assert [c.shapes[0][0] for c in floats] == [11] * 9 + [1]  # 11 elements + the divisor = 48 bytes
    assert torch.equal(model.big.grad, torch.arange(100, dtype=FP32).reshape(10, 10) / 2)


# ----------------------------------------------------------------- errors


def test_sparse_gradient_raises_naming_param_and_leaves_grads_unchanged(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner()
    model.emb = nn.Embedding(6, 3, sparse=True)
    model.emb(torch.tensor([1, 4])).sum().backward()
    assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
    _set_grads(model, lambda fqn, p: p.grad if fqn == "emb.weight" else _known_grad(fqn, p))
    dense_before = {fqn: g for fqn, g in _grad_snapshot(model).items() if fqn != "emb.weight"}
    sparse_before = model.emb.weight.grad.to_dense().clone()
    with pytest.raises(RuntimeError, match=r"emb\.weight"):
        synchronize_tp_replica_gradients(model, dp_tp_mesh)
    assert model.emb.weight.grad.is_sparse
    assert torch.equal(model.emb.weight.grad.to_dense(), sparse_before)
    for fqn, g in dense_before.items():
        assert torch.equal(model.get_parameter(fqn).grad, g), fqn


def test_sparse_gradient_in_excluded_subtree_is_allowed(dp_tp_mesh: DeviceMesh) -> None:
    model = _Owner()
    model.owned = nn.Embedding(6, 3, sparse=True)
    exclude_from_tp_replica_sync(model.owned)
    model.owned(torch.tensor([1, 4])).sum().backward()
    _set_grads(model, lambda fqn, p: p.grad if fqn == "owned.weight" else _known_grad(fqn, p))
    assert synchronize_tp_replica_gradients(model, dp_tp_mesh) == 3
    assert model.owned.weight.grad.is_sparse


def test_unknown_reduction_mark_raises_value_error() -> None:
    with pytest.raises(ValueError, match="max"):
        mark_tp_replica_gradient_reduction(nn.Linear(2, 2), "max")  # type: ignore[arg-type]
