"""TP-replica synchronization with real collectives: 4 gloo ranks on CPU.

Two layouts of a world of 4: a (dp=2, tp=2) mesh, whose TP groups are ranks
(0, 1) and (2, 3), and a 1-D (tp=4) mesh. Every rank holds different
gradients and tensors (they depend on the rank), so a correct result can only
come from real communication. Spawning 4 processes costs seconds, so each
spawned run performs several steps and returns plain data (rank-local tensors,
strings, timings); module-scoped fixtures run each spawn once and the small
tests below each assert one behaviour on that data. Every process group has a
collective timeout and every spawn a join timeout (``run_distributed``).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdptx import (
    broadcast_tp_replicas,
    exclude_from_tp_replica_sync,
    iter_unique_named_parameters,
    mark_tp_replica_gradient_reduction,
    synchronize_tp_replica_gradients,
)
from fsdptx.testing import record_collectives, run_distributed

WORLD = 4
BF16 = torch.bfloat16
FP32 = torch.float32
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "dp2xtp2": ((2, 2), ("dp", "tp")),
    "tp4": ((4,), ("tp",)),
}
SPAWN_TIMEOUT_S = 300.0  # limit of one spawned run, start-up included (a backstop: minutes on a loaded CI machine)
COLLECTIVE_TIMEOUT_S = 20.0  # gloo process-group timeout: a hung collective raises
ERROR_BOUND_S = 10.0  # an error must surface well before a collective would time out
SLICE_BUDGET = 48  # bytes: 12 fp32 elements per buffer

# Per-rank bf16 values whose fp32 sum, cast once, differs from every way of
# summing them in bf16 (checked in test_bf16_values_are_sensitive_to_accumulation_dtype).
BF16_SENSITIVE = (99.0, 498.0, 2768.0, -28.5)


# ---------------------------------------------------------------- shared helpers


def tp_peers(layout: str, rank: int) -> tuple[int, ...]:
    """The global ranks of ``rank``'s TP group (TP coordinate 0 first)."""
    if layout == "tp4":
        return (0, 1, 2, 3)
    start = rank - rank % 2
    return (start, start + 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``p``'s kind: a DTensor on p's mesh and placements, or plain."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local


def _rank_values(fqn: str, rank: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Small integers, different on every rank and for every tensor: sums and
    halves/quarters of them are exact in fp32, whatever the summation order."""
    offset = sum(map(ord, fqn)) % 5
    values = (torch.arange(shape.numel()) % 7 + 1) * (rank + 1) + offset
    return values.reshape(shape).to(dtype)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        fqn: None if p.grad is None else _local(p.grad).detach().clone()
        for fqn, p in iter_unique_named_parameters(model)
    }


def _grad_specs(model: nn.Module) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Per param: the grad's type name, placements (or "None") and global shape."""
    return {
        fqn: (type(p.grad).__name__, str(getattr(p.grad, "placements", None)), tuple(p.grad.shape))
        for fqn, p in model.named_parameters()
        if p.grad is not None
    }


def _set_rank_grads(model: nn.Module, rank: int) -> None:
    for fqn, p in iter_unique_named_parameters(model):
        local = _local(p)
        p.grad = _like(p, _rank_values(fqn, rank, local.shape, local.dtype))


def _placements_on_tp(mesh: DeviceMesh, tp: Shard | Replicate) -> list[Shard | Replicate]:
    names = mesh.mesh_dim_names or ()
    return [tp if name == "tp" else Replicate() for name in names]


def _dtensor_param(mesh: DeviceMesh, placements: list[Any], local_shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(DTensor.from_local(torch.zeros(local_shape), mesh, placements, run_check=False))


# ------------------------------------------------------------------- models


class _SyncModel(nn.Module):
    """Replicated fp32/bf16 params with mean and sum marks, an excluded
    subtree, a real FSDP2 unit (a DTensor on the dp submesh: a plain replica
    as far as TP goes), DTensor params replicated on tp (and sharded on dp
    where there is one), which DTensor keeps alike itself, and a DTensor
    param sharded on tp."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mean_lin = nn.Linear(3, 2)
        self.sum_lin = nn.Linear(3, 2)
        self.bf16_mean = nn.Linear(3, 4, bias=False, dtype=BF16)
        self.bf16_sum = nn.Linear(3, 4, bias=False, dtype=BF16)
        self.owned = nn.Sequential(nn.Linear(3, 2))
        self.dt_rep = nn.Module()
        self.dt_rep.weight = _dtensor_param(mesh, _placements_on_tp(mesh, Replicate()), (4, 3))
        self.dt_tp_shard = nn.Module()
        self.dt_tp_shard.weight = _dtensor_param(mesh, _placements_on_tp(mesh, Shard(0)), (2, 3))
        mark_tp_replica_gradient_reduction(self.sum_lin, "sum")
        mark_tp_replica_gradient_reduction(self.bf16_sum, "sum")
        exclude_from_tp_replica_sync(self.owned)
        if "dp" in (mesh.mesh_dim_names or ()):
            self.dt_dp_shard = nn.Module()
            self.dt_dp_shard.weight = _dtensor_param(mesh, [Shard(0), Replicate()], (2, 3))
            self.fsdp_sum = nn.Linear(4, 4)
            mark_tp_replica_gradient_reduction(self.fsdp_sum, "sum")
            fully_shard(self.fsdp_sum, mesh=mesh["dp"])  # after marking: the mark must survive


REDUCTIONS: dict[str, str] = {  # the reduction each replicated param of _SyncModel must get
    "mean_lin.weight": "mean",
    "mean_lin.bias": "mean",
    "sum_lin.weight": "sum",
    "sum_lin.bias": "sum",
    "bf16_mean.weight": "mean",
    "bf16_sum.weight": "sum",
    "fsdp_sum.weight": "sum",
    "fsdp_sum.bias": "sum",
}
# Excluded, sharded on tp, or Replicate DTensors on the TP mesh: their
# gradients are DTensor's to reduce (the rank-dependent ones set here break
# its promise on purpose, so a sync that touched them would show).
UNTOUCHED = ("owned.0.weight", "owned.0.bias", "dt_tp_shard.weight", "dt_rep.weight", "dt_dp_shard.weight")


class _BroadcastModel(nn.Module):
    """Rank-dependent params and buffers of every kind broadcast must handle."""

    def __init__(self, mesh: DeviceMesh, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.low = nn.Parameter(torch.zeros(4, dtype=BF16))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("rope", torch.zeros(5), persistent=False)
        self.owned = nn.Linear(3, 2)
        self.owned.register_buffer("counter", torch.zeros(2, dtype=torch.int64))
        exclude_from_tp_replica_sync(self.owned)
        self.dt_rep = nn.Module()
        self.dt_rep.weight = _dtensor_param(mesh, _placements_on_tp(mesh, Replicate()), (4, 3))
        self.dt_tp_shard = nn.Module()
        self.dt_tp_shard.weight = _dtensor_param(mesh, _placements_on_tp(mesh, Shard(0)), (2, 3))
        with torch.no_grad():
            for name, t in self.tensors():
                local = _local(t)
                local.copy_(_rank_values(name, rank, local.shape, local.dtype) + 100 * rank)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.named_parameters(), *self.named_buffers()]


BROADCAST_COPIED = ("lin.weight", "lin.bias", "low", "dt_rep.weight", "steps", "rope")
BROADCAST_KEPT = ("owned.weight", "owned.bias", "owned.counter", "dt_tp_shard.weight")


# ------------------------------------------------------------- the spawned runs


def _sync_and_broadcast_worker(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    shape, names = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out: dict[str, Any] = {}

    model = _SyncModel(mesh)
    _set_rank_grads(model, rank)
    out["before"] = _snapshot(model)
    out["specs_before"] = _grad_specs(model)
    out["count"] = synchronize_tp_replica_gradients([model], mesh)
    out["after"] = _snapshot(model)
    out["specs_after"] = _grad_specs(model)

    # bf16 gradients whose fp32 reduction differs from any bf16 reduction
    sens = nn.Module()
    sens.mean = nn.Parameter(torch.zeros(4, dtype=BF16))
    sens.summed = nn.Module()
    sens.summed.w = nn.Parameter(torch.zeros(4, dtype=BF16))
    mark_tp_replica_gradient_reduction(sens.summed, "sum")
    peers = tp_peers(layout, rank)
    values = torch.tensor([BF16_SENSITIVE[(peers.index(rank) + j) % 4] for j in range(4)], dtype=BF16)
    sens.mean.grad, sens.summed.w.grad = values.clone(), values.clone()
    synchronize_tp_replica_gradients(sens, mesh)
    out["sensitive"] = {"mean": sens.mean.grad.clone(), "sum": sens.summed.w.grad.clone()}

    # one tensor (and a bf16 one) larger than a tiny budget: sliced across buffers
    big = nn.Module()
    big.w = nn.Parameter(torch.zeros(10, 10))
    big.h = nn.Parameter(torch.zeros(5, 5, dtype=BF16))
    _set_rank_grads(big, rank)
    out["big_before"] = _snapshot(big)
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(big, mesh, max_bytes=SLICE_BUDGET)
    out["big_after"] = _snapshot(big)
    out["big_buffers"] = [(c.shapes[0], c.dtypes[0]) for c in calls if c.dtypes[0].is_floating_point]

    bmodel = _BroadcastModel(mesh, rank)
    out["b_before"] = {n: _local(t).detach().clone() for n, t in bmodel.tensors()}
    out["b_count"] = broadcast_tp_replicas([bmodel], mesh, max_bytes=SLICE_BUDGET)
    out["b_after"] = {n: _local(t).detach().clone() for n, t in bmodel.tensors()}
    out["b_dtypes"] = {n: _local(t).dtype for n, t in bmodel.tensors()}
    return out


class _ErrModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(2, 2, bias=False)
        self.emb = nn.Embedding(6, 3, sparse=True)


def _attempt(model: nn.Module, mesh: DeviceMesh) -> dict[str, Any]:
    """Synchronize and report what happened, and whether any grad changed."""
    before = {
        fqn: None if p.grad is None else p.grad.to_dense().clone() if p.grad.is_sparse else p.grad.clone()
        for fqn, p in model.named_parameters()
    }
    start = time.monotonic()
    try:
        synchronize_tp_replica_gradients(model, mesh)
        error: tuple[str, str] | None = None
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        error = (type(e).__name__, str(e))
    elapsed = time.monotonic() - start
    unchanged = True
    for fqn, p in model.named_parameters():
        g = p.grad
        if (g is None) != (before[fqn] is None):
            unchanged = False
        elif g is not None:
            unchanged &= torch.equal(g.to_dense() if g.is_sparse else g, before[fqn])  # type: ignore[arg-type]
    return {"error": error, "elapsed": elapsed, "unchanged": unchanged}


def _err_model(rank: int, *, grad_none_on: int | None = None, sparse_on: int | None = None) -> _ErrModel:
    model = _ErrModel()
    _set_rank_grads(model, rank)
    if rank == grad_none_on:
        model.b.weight.grad = None
    if rank == sparse_on:
        model.emb.weight.grad = None
        model.emb(torch.tensor([1, 4])).sum().backward()
    return model


def _errors_worker(rank: int, world_size: int) -> dict[str, Any]:
    tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    out["presence_tp4"] = _attempt(_err_model(rank, grad_none_on=2), tp4)
    out["sparse_tp4"] = _attempt(_err_model(rank, sparse_on=1), tp4)
    out["presence_dp_tp"] = _attempt(_err_model(rank, grad_none_on=1), dp_tp)  # TP group (0, 1) only
    clean = _err_model(rank)
    out["clean_before"] = _snapshot(clean)
    out["clean"] = _attempt(clean, tp4)
    out["clean_after"] = _snapshot(clean)
    return out


@functools.cache
def _sync_results(layout: str) -> list[dict[str, Any]]:
    return run_distributed(
        _sync_and_broadcast_worker,
        WORLD,
        layout,
        timeout_s=SPAWN_TIMEOUT_S,
        collective_timeout_s=COLLECTIVE_TIMEOUT_S,
    )


@functools.cache
def _error_results() -> list[dict[str, Any]]:
    return run_distributed(
        _errors_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(layout, per-rank results) of the sync/broadcast run on that layout."""
    return request.param, _sync_results(request.param)


@pytest.fixture(scope="module")
def errors() -> list[dict[str, Any]]:
    return _error_results()


def _reduced(layout: str, results: list[dict[str, Any]], key: str, fqn: str, rank: int, how: str) -> torch.Tensor:
    """What ``fqn``'s grad must be on ``rank``: the fp32 sum over its TP group
    of every peer's original local grad (divided by the group size for a
    mean), cast back to the grad's dtype."""
    peers = tp_peers(layout, rank)
    originals = [results[p][key][fqn] for p in peers]
    total = torch.stack([g.to(FP32) for g in originals]).sum(0)
    if how == "mean":
        total = total / len(peers)
    return total.to(originals[0].dtype)


# ------------------------------------------------------------------ sync tests


@pytest.mark.parametrize(("reduction", "at_least"), [("mean", 3), ("sum", 3)])
def test_gradients_equal_their_tp_group_reduction(
    run: tuple[str, list[dict[str, Any]]], reduction: str, at_least: int
) -> None:
    """Mean-reduced gradients equal the TP-group mean, sum-marked ones the sum."""
    layout, results = run
    checked = 0
    for rank in range(WORLD):
        for fqn, how in REDUCTIONS.items():
            if how == reduction and fqn in results[rank]["after"]:
                expect = _reduced(layout, results, "before", fqn, rank, reduction)
                assert torch.equal(results[rank]["after"][fqn], expect), (rank, fqn)
                checked += 1
    assert checked >= at_least * WORLD


def test_sum_mark_set_before_fully_shard_gives_sum_with_real_peers() -> None:
    results = _sync_results("dp2xtp2")
    for rank in range(WORLD):
        for fqn in ("fsdp_sum.weight", "fsdp_sum.bias"):
            expect = _reduced("dp2xtp2", results, "before", fqn, rank, "sum")
            assert torch.equal(results[rank]["after"][fqn], expect), (rank, fqn)


def test_synchronized_gradients_are_identical_across_tp_peers(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    for rank in range(WORLD):
        for peer in tp_peers(layout, rank):
            for fqn in REDUCTIONS:
                if fqn in results[rank]["after"]:
                    assert torch.equal(results[rank]["after"][fqn], results[peer]["after"][fqn]), (rank, peer, fqn)


def test_gradients_differed_across_tp_peers_before_sync(run: tuple[str, list[dict[str, Any]]]) -> None:
    """Guards the tests above: identical inputs would make them vacuous."""
    layout, results = run
    for fqn in REDUCTIONS:
        if fqn in results[0]["before"]:
            peer = tp_peers(layout, 0)[1]
            assert not torch.equal(results[0]["before"][fqn], results[peer]["before"][fqn]), fqn


def test_excluded_tp_sharded_and_tp_mesh_dtensor_gradients_are_untouched(
    run: tuple[str, list[dict[str, Any]]]
) -> None:
    layout, results = run
    checked = 0
    for rank in range(WORLD):
        for fqn in UNTOUCHED:
            if fqn in results[rank]["after"]:  # dt_dp_shard exists only with a dp dim
                assert torch.equal(results[rank]["after"][fqn], results[rank]["before"][fqn]), (rank, fqn)
                checked += 1
    assert checked == WORLD * (len(UNTOUCHED) - (layout != "dp2xtp2"))


def test_sync_returns_number_of_synchronized_gradients(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    expected = sum(1 for fqn in REDUCTIONS if fqn in results[0]["after"])
    assert expected == (8 if layout == "dp2xtp2" else 6)
    assert [r["count"] for r in results] == [expected] * WORLD


def test_dtensor_gradients_keep_type_shape_and_placements(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    dtensors = {f for f, spec in results[0]["specs_before"].items() if spec[0] == "DTensor"}
    assert len(dtensors) == (5 if layout == "dp2xtp2" else 2)
    for rank in range(WORLD):
        assert results[rank]["specs_after"] == results[rank]["specs_before"], rank


def test_gradient_dtypes_are_kept(run: tuple[str, list[dict[str, Any]]]) -> None:
    _layout, results = run
    for rank in range(WORLD):
        for fqn, g in results[rank]["after"].items():
            assert g.dtype == results[rank]["before"][fqn].dtype, (rank, fqn)


def _bf16_orders(values: tuple[float, ...]) -> set[float]:
    """Every result of adding ``values`` in bf16: each order as a left fold,
    and each order as a balanced pairwise tree (all binary trees of 4 leaves)."""
    results: set[float] = set()
    for order in itertools.permutations(torch.tensor(values, dtype=BF16)):
        fold = order[0]
        for v in order[1:]:
            fold = fold + v
        results.add(fold.item())
        results.add(((order[0] + order[1]) + (order[2] + order[3])).item())
    return results


def test_bf16_values_are_sensitive_to_accumulation_dtype() -> None:
    """The test below only proves fp32 accumulation if bf16 summation, in any
    order, would give something else, for the sum and for the mean."""
    assert all(torch.tensor(v, dtype=BF16).item() == v for v in BF16_SENSITIVE)
    fp32_sum = torch.tensor(sum(BF16_SENSITIVE), dtype=FP32)
    bf16_sums = _bf16_orders(BF16_SENSITIVE)
    assert fp32_sum.to(BF16).item() not in bf16_sums
    assert (fp32_sum / 4).to(BF16).item() not in {torch.tensor(s / 4, dtype=BF16).item() for s in bf16_sums}


@pytest.mark.parametrize("how", ["mean", "sum"])
def test_bf16_gradients_are_accumulated_in_fp32(how: str) -> None:
    results = _sync_results("tp4")
    fp32_sum = torch.tensor(sum(BF16_SENSITIVE), dtype=FP32)
    expect = (fp32_sum / 4 if how == "mean" else fp32_sum).to(BF16)
    for rank in range(WORLD):
        got = results[rank]["sensitive"][how]
        assert got.dtype == BF16
        assert torch.equal(got, expect.expand(4)), (rank, got, expect)


def test_tensor_larger_than_budget_is_synchronized_in_slices(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    for rank in range(WORLD):
        for fqn in ("w", "h"):
            expect = _reduced(layout, results, "big_before", fqn, rank, "mean")
            assert torch.equal(results[rank]["big_after"][fqn], expect), (rank, fqn)


def test_sliced_buffers_respect_the_budget(run: tuple[str, list[dict[str, Any]]]) -> None:
    _layout, results = run
    buffers = results[0]["big_buffers"]
    per_buffer = SLICE_BUDGET // 4 - 1  # one fp32 slot of the budget holds the mean's divisor
    assert len(buffers) == -(-(100 + 25) // per_buffer)  # the fewest the budget allows
    assert all(dtype == FP32 and (shape[0] + 1) * 4 <= SLICE_BUDGET for shape, dtype in buffers)


# ------------------------------------------------------------- broadcast tests


def test_broadcast_makes_replicated_tensors_equal_to_tp_rank0(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    for rank in range(WORLD):
        src = tp_peers(layout, rank)[0]
        for name in BROADCAST_COPIED:
            assert torch.equal(results[rank]["b_after"][name], results[src]["b_before"][name]), (rank, name)


def test_broadcast_covers_int64_and_non_persistent_buffers(run: tuple[str, list[dict[str, Any]]]) -> None:
    layout, results = run
    assert results[0]["b_dtypes"]["steps"] == torch.int64
    peer = tp_peers(layout, 0)[1]
    for name in ("steps", "rope"):
        assert not torch.equal(results[peer]["b_before"][name], results[0]["b_before"][name])
        assert torch.equal(results[peer]["b_after"][name], results[0]["b_before"][name]), name


def test_broadcast_leaves_excluded_and_tp_sharded_tensors_alone(run: tuple[str, list[dict[str, Any]]]) -> None:
    _layout, results = run
    for rank in range(WORLD):
        for name in BROADCAST_KEPT:
            assert torch.equal(results[rank]["b_after"][name], results[rank]["b_before"][name]), (rank, name)


def test_broadcast_returns_number_of_tensors_broadcast(run: tuple[str, list[dict[str, Any]]]) -> None:
    _layout, results = run
    assert [r["b_count"] for r in results] == [len(BROADCAST_COPIED)] * WORLD


# ----------------------------------------------------------------- error tests


def _assert_raised_everywhere(
    errors: list[dict[str, Any]], key: str, ranks: range | tuple[int, ...], needle: str
) -> None:
    for rank in ranks:
        outcome = errors[rank][key]
        assert outcome["error"] is not None, f"rank {rank} did not raise"
        kind, message = outcome["error"]
        assert kind == "RuntimeError" and needle in message, (rank, kind, message)


def test_grad_presence_mismatch_raises_on_every_rank(errors: list[dict[str, Any]]) -> None:
    _assert_raised_everywhere(errors, "presence_tp4", range(WORLD), "b.weight")


def test_sparse_gradient_on_one_rank_raises_on_every_rank(errors: list[dict[str, Any]]) -> None:
    _assert_raised_everywhere(errors, "sparse_tp4", range(WORLD), "emb.weight")


def test_presence_mismatch_raises_only_in_the_tp_group_concerned(errors: list[dict[str, Any]]) -> None:
    _assert_raised_everywhere(errors, "presence_dp_tp", (0, 1), "b.weight")
    assert [errors[r]["presence_dp_tp"]["error"] for r in (2, 3)] == [None, None]


@pytest.mark.parametrize("case", ["presence_tp4", "sparse_tp4", "presence_dp_tp"])
def test_failed_sync_leaves_every_gradient_unchanged(errors: list[dict[str, Any]], case: str) -> None:
    failed = [r for r in range(WORLD) if errors[r][case]["error"] is not None]
    assert failed
    assert all(errors[r][case]["unchanged"] for r in failed), case


@pytest.mark.parametrize("case", ["presence_tp4", "sparse_tp4", "presence_dp_tp"])
def test_sync_errors_surface_within_bounded_time(errors: list[dict[str, Any]], case: str) -> None:
    assert max(errors[r][case]["elapsed"] for r in range(WORLD)) < ERROR_BOUND_S


def test_group_stays_usable_after_sync_errors(errors: list[dict[str, Any]]) -> None:
    """No rank was left inside (or ahead by) a collective: a clean sync after
    the three failures still produces the exact TP-group mean."""
    assert all(errors[r]["clean"]["error"] is None for r in range(WORLD))
    for rank in range(WORLD):
        for fqn in ("a.weight", "a.bias", "b.weight", "emb.weight"):
            expect = _reduced("tp4", errors, "clean_before", fqn, rank, "mean")
            assert torch.equal(errors[rank]["clean_after"][fqn], expect), (rank, fqn)

