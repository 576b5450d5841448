"""Argument validation and the layout cache of TP sync, on fake meshes.
Real peers disagreeing are in
``test_sync_agreement_gloo.py``."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import fsdptx
from fsdptx import broadcast_tp_replicas, mark_tp_replica_gradient_reduction, synchronize_tp_replica_gradients
from fsdptx.testing import fake_mesh, record_collectives


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh((2,), ("tp",)) as m:
        yield m


def _mixed() -> nn.Module:
    """fp32 and fp64 params with integer-valued grads (exact halves)."""
    model = nn.Module()
    model.a = nn.Linear(3, 2)
    model.d = nn.Linear(2, 2, dtype=torch.float64)
    for i, p in enumerate(model.parameters()):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + i
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _same(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    return a.keys() == b.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in
        ((a[k], b[k]) for k in a)
    )


@pytest.mark.parametrize(
    ("max_bytes", "error"),
    [(4, ValueError), (8, ValueError), (10.5, TypeError), (0, ValueError), (-8, ValueError), (True, TypeError),
     ("64", TypeError)],
)
def test_invalid_max_bytes_raises_before_any_collective_with_grads_unchanged(
    mesh: DeviceMesh, max_bytes: object, error: type[Exception]
) -> None:
    """fp32 grads come first in the buffer order: before, max_bytes=4 reduced
    them and then refused the fp64 ones; a retry double-counted ``sum``."""
    model = _mixed()
    before = _grads(model)
    with record_collectives() as calls, pytest.raises(error, match="max_bytes"):
        synchronize_tp_replica_gradients(model, mesh, max_bytes=max_bytes)  # type: ignore[arg-type]
    assert calls == []
    assert _same(before, _grads(model))


def test_too_small_max_bytes_names_the_parameters(mesh: DeviceMesh) -> None:
    with pytest.raises(ValueError, match=r"d\.weight"):
        synchronize_tp_replica_gradients(_mixed(), mesh, max_bytes=12)


@pytest.mark.parametrize(("max_bytes", "error"), [(0, ValueError), (2.0, TypeError), (2, ValueError)])
def test_broadcast_invalid_max_bytes_raises_before_any_collective(
    mesh: DeviceMesh, max_bytes: object, error: type[Exception]
) -> None:
    model = _mixed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with record_collectives() as calls, pytest.raises(error, match="max_bytes"):
        broadcast_tp_replicas(model, mesh, max_bytes=max_bytes)  # type: ignore[arg-type]
    assert calls == []
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("bad", [{"model_parts": 3}, {"tp_axis_name": 1}, {"device_mesh": "tp"}])
def test_invalid_other_arguments_raise_type_error(mesh: DeviceMesh, bad: dict[str, object]) -> None:
    kwargs: dict[str, object] = {"model_parts": _mixed(), "device_mesh": mesh, "tp_axis_name": "tp"}
    kwargs.update(bad)
    with record_collectives() as calls, pytest.raises(TypeError):
        synchronize_tp_replica_gradients(**kwargs)  # type: ignore[arg-type]
    assert calls == []


# ----------------------------------------------------------------- the cache


def _float_payloads(calls: list) -> list[tuple[tuple[int, ...], torch.dtype]]:  # type: ignore[type-arg]
    return [(c.shapes[0], c.dtypes[0]) for c in calls if c.dtypes[0].is_floating_point]


def _fresh_result(build: object, mesh: DeviceMesh) -> dict[str, torch.Tensor | None]:
    model = build()  # type: ignore[operator]
    synchronize_tp_replica_gradients(model, mesh)
    return _grads(model)


def _model() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(3, 2)
    model.b = nn.Linear(2, 2, bias=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    return model


Observed = tuple[dict[str, torch.Tensor | None], list[tuple[str, tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]], list[torch.Tensor]]


def _observe_sync(model: nn.Module, mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> Observed:
    """One sync of ``model`` with every gradient 4: the gradients after it,
    the collectives it issued (op, shapes, dtypes) and what it told the
    peers in its agreement (the values it sent them: the layout's digest
    among them)."""
    sent: list[torch.Tensor] = []
    real = dist.all_to_all_single

    def spy(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(input.clone())
        return real(output, input, *args, **kwargs)

    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    with monkeypatch.context() as m, record_collectives() as calls:
        m.setattr(dist, "all_to_all_single", spy)
        synchronize_tp_replica_gradients(model, mesh)
    return _grads(model), [(c.op, c.shapes, c.dtypes) for c in calls], sent


def _same_observed(a: Observed, b: Observed) -> bool:
    return (
        _same(a[0], b[0]) and a[1] == b[1] and len(a[2]) == len(b[2])
        and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))
    )


def _after_a_change_as_without_the_cache(
    build: Callable[[], nn.Module], change: Callable[[nn.Module], None], mesh: DeviceMesh,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Observed, Observed]:
    """A sync of a model changed after its layout was cached, and of a model
    built and changed alike, synchronized with caches off: the first must
    be the second if the change invalidated the cache."""
    model = build()
    synchronize_tp_replica_gradients(model, mesh)
    change(model)
    cached = _observe_sync(model, mesh, monkeypatch)
    fresh = build()
    change(fresh)
    with fsdptx.caches(enabled=False):
        plain = _observe_sync(fresh, mesh, monkeypatch)
    return cached, plain


def test_cached_calls_repeat_the_first_calls_collectives(mesh: DeviceMesh) -> None:
    model = _model()
    with record_collectives() as first:
        synchronize_tp_replica_gradients(model, mesh)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    with record_collectives() as second:
        synchronize_tp_replica_gradients(model, mesh)
    assert first == second
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


def test_changing_a_mark_invalidates_the_cache(mesh: DeviceMesh) -> None:
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    mark_tp_replica_gradient_reduction(model.b, "sum")
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    synchronize_tp_replica_gradients(model, mesh)
    assert torch.equal(model.b.weight.grad, torch.full((2, 2), 4.0))  # summed: unchanged on a fake group
    assert torch.equal(model.a.weight.grad, torch.full((2, 3), 2.0))


def test_adding_a_parameter_invalidates_the_cache(mesh: DeviceMesh) -> None:
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.b.extra = nn.Parameter(torch.zeros(5))
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    with record_collectives() as calls:
        count = synchronize_tp_replica_gradients(model, mesh)
    assert count == 4
    assert _float_payloads(calls) == [((6 + 2 + 4 + 5,), torch.float32)]
    assert torch.equal(model.b.extra.grad, torch.full((5,), 2.0))


def test_replacing_a_submodule_invalidates_the_cache(mesh: DeviceMesh) -> None:
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.b = nn.Linear(2, 7, bias=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, mesh)
    assert _float_payloads(calls) == [((6 + 2 + 14,), torch.float32)]


def test_grad_presence_change_invalidates_the_plan(mesh: DeviceMesh) -> None:
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.a.bias.grad = None
    model.a.weight.grad = torch.ones(2, 3) * 4
    model.b.weight.grad = torch.ones(2, 2) * 4
    with record_collectives() as calls:
        count = synchronize_tp_replica_gradients(model, mesh)
    assert count == 2 and model.a.bias.grad is None
    assert _float_payloads(calls) == [((6 + 4,), torch.float32)]


def test_grad_dtype_change_invalidates_the_plan(mesh: DeviceMesh) -> None:
    """The same parameter object now holds fp64 (``.data`` swapped): its grad
    travels in an fp64 buffer of its own, and the agreement sees the change."""
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.b.weight.data = model.b.weight.data.double()
    model.b.weight.grad = torch.ones(2, 2, dtype=torch.float64) * 4
    for p in (model.a.weight, model.a.bias):
        p.grad = torch.ones_like(p) * 4
    with record_collectives() as calls:
        synchronize_tp_replica_gradients(model, mesh)
    assert _float_payloads(calls) == [((8,), torch.float32), ((4,), torch.float64)]
    assert torch.equal(model.b.weight.grad, torch.full((2, 2), 2.0, dtype=torch.float64))


def test_cache_does_not_travel_with_a_deep_copy(mesh: DeviceMesh) -> None:
    import copy

    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    clone = copy.deepcopy(model)
    for p in clone.parameters():
        p.grad = torch.ones_like(p) * 4
    synchronize_tp_replica_gradients(clone, mesh)
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in clone.parameters())


def _siblings() -> nn.Module:
    model = nn.Module()
    model.a = nn.Module()
    model.b = nn.Module()
    model.a.w = nn.Parameter(torch.zeros(3))
    return model


def _move_w_to_b(model: nn.Module) -> None:
    w = model.a.w
    del model.a.w
    model.b.w = w


def test_moving_a_parameter_to_a_sibling_invalidates_the_cache(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same object, same local name, next module in the walk: only the FQN
    changes, and with it what the peers are told (the cache check delimits
    modules)."""
    cached, plain = _after_a_change_as_without_the_cache(_siblings, _move_w_to_b, mesh, monkeypatch)
    assert _same_observed(cached, plain)
    assert torch.equal(cached[0]["b.w"], torch.full((3,), 2.0))  # type: ignore[arg-type]


def _rename_b_weight(model: nn.Module) -> None:
    w = model.b.weight
    del model.b.weight
    model.b.renamed = w


def test_renaming_a_parameter_invalidates_the_cache(mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    cached, plain = _after_a_change_as_without_the_cache(_model, _rename_b_weight, mesh, monkeypatch)
    assert _same_observed(cached, plain)
    assert list(cached[0]) == ["a.weight", "a.bias", "b.renamed"]


def test_an_empty_parameter_slot_traded_for_a_new_parameter_invalidates_the_cache(mesh: DeviceMesh) -> None:
    """``b.bias`` is registered as None; dropping that slot while adding a
    parameter elsewhere keeps the number of slots but changes the set."""
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    del model.b.bias
    model.a.extra = nn.Parameter(torch.zeros(3))
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    assert synchronize_tp_replica_gradients(model, mesh) == 4
    assert torch.equal(model.a.extra.grad, torch.full((3,), 2.0))


def test_filling_an_empty_parameter_slot_invalidates_the_cache(mesh: DeviceMesh) -> None:
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.b.bias = nn.Parameter(torch.zeros(2))
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    assert synchronize_tp_replica_gradients(model, mesh) == 4
    assert torch.equal(model.b.bias.grad, torch.full((2,), 2.0))


def test_replacing_a_modules_parameter_dict_invalidates_the_cache(mesh: DeviceMesh) -> None:
    """A change made in the new dict is seen: the parameter added there is
    synchronized too."""
    model = _model()
    synchronize_tp_replica_gradients(model, mesh)
    model.b.__dict__["_parameters"] = dict(model.b._parameters)
    synchronize_tp_replica_gradients(model, mesh)
    model.b._parameters["extra"] = nn.Parameter(torch.zeros(5))
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    with record_collectives() as calls:
        assert synchronize_tp_replica_gradients(model, mesh) == 4
    assert _float_payloads(calls) == [((6 + 2 + 4 + 5,), torch.float32)]
    assert torch.equal(model.b.extra.grad, torch.full((5,), 2.0))


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.double(),
        lambda m: setattr(m.b.weight, "data", torch.zeros(4)),
        lambda m: torch.utils.swap_tensors(m.b.weight, nn.Parameter(torch.zeros(2, 2, dtype=torch.float16))),
    ],
    ids=["cast", "data_shape", "swap_tensors"],
)
def test_changing_a_parameter_in_place_invalidates_the_cache(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch, change: Any
) -> None:
    """The same Parameter objects under the same names, but what the peers
    are told must describe their dtype and shape now."""
    cached, plain = _after_a_change_as_without_the_cache(_model, change, mesh, monkeypatch)
    assert _same_observed(cached, plain)
    assert all(torch.equal(g, torch.full_like(g, 2.0)) for g in cached[0].values())  # type: ignore[arg-type]


def test_broadcast_after_a_cast_does_not_round_through_the_old_buffer(mesh: DeviceMesh) -> None:
    model = nn.Linear(2, 2, bias=False)
    broadcast_tp_replicas(model, mesh)
    model.double()
    with torch.no_grad():
        model.weight.fill_(1 / 3)
    broadcast_tp_replicas(model, mesh)
    assert model.weight.dtype == torch.float64
    assert torch.equal(model.weight, torch.full((2, 2), 1 / 3, dtype=torch.float64))


def test_a_remembered_mesh_that_died_does_not_answer_for_no_mesh() -> None:
    """A dead weak reference reads as None, which is what ``device_mesh``
    is when there is nothing to synchronize."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    with fake_mesh((2,), ("tp",)):
        m = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        for _ in range(2):  # the first call makes the cache, the second remembers the context on it
            synchronize_tp_replica_gradients(model, m)
        group = m.get_group()  # kept alive, as torch.distributed's registry keeps a real one
        mesh_ref = weakref.ref(m)
        del m
        gc.collect()
        assert mesh_ref() is None  # the model does not keep the mesh alive
        for p in model.parameters():
            p.grad = torch.ones_like(p) * 4
        with record_collectives() as calls:
            assert synchronize_tp_replica_gradients(model, None) == 0
            assert broadcast_tp_replicas(model, None) == 0
        assert calls == [] and group is not None
        assert all(torch.equal(p.grad, torch.full_like(p, 4.0)) for p in model.parameters())


def test_a_dtensor_gradient_on_a_plain_parameter_is_reduced_through_its_local_storage() -> None:
    """Laid out by its rank-local shape, like every DTensor gradient; it
    used to be laid out by its global shape and fail after earlier chunks
    were already reduced."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        model = nn.Module()
        model.a = nn.Parameter(torch.zeros(5))
        model.b = nn.Parameter(torch.zeros(4, 2))
        model.a.grad = torch.full((5,), 4.0)
        model.b.grad = distribute_tensor(torch.full((4, 2), 4.0), mesh, [Shard(0), Replicate()])
        assert synchronize_tp_replica_gradients(model, mesh, max_bytes=24) == 2
        assert torch.equal(model.a.grad, torch.full((5,), 2.0))
        assert torch.equal(model.b.grad.to_local(), torch.full((2, 2), 2.0))


@pytest.mark.parametrize("call", [synchronize_tp_replica_gradients, broadcast_tp_replicas])
def test_empty_model_parts_raise_before_any_collective(mesh: DeviceMesh, call: Any) -> None:
    with record_collectives() as calls, pytest.raises(ValueError, match="model_parts is empty"):
        call([], mesh)
    assert calls == []


def test_the_remembered_tp_context_keeps_neither_mesh_nor_group_alive() -> None:
    """A process group kept alive by a model's cache past its destruction
    aborts the process at interpreter exit."""
    model = _model()
    with fake_mesh((2,), ("tp",)) as m:
        for _ in range(3):
            synchronize_tp_replica_gradients(model, m)
        mesh_ref, group_ref = weakref.ref(m), weakref.ref(m.get_group())
    del m
    gc.collect()
    assert mesh_ref() is None and group_ref() is None


# ------------------------------------------- where the agreement's values live


@pytest.fixture
def storages(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(collective, storage address of its first tensor) for every
    all-to-all (the agreement) and all-reduce or broadcast (the data), in
    issue order.
    The tensors are kept alive, so no later allocation can reuse an
    address and make two storages look like one."""
    seen: list[tuple[str, int]] = []
    kept: list[torch.Tensor] = []
    for name in ("all_to_all_single", "all_reduce", "broadcast"):
        real = getattr(dist, name)

        def spy(tensor: torch.Tensor, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            kept.append(tensor)
            seen.append((_name, tensor.untyped_storage().data_ptr()))
            return _real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, name, spy)
    return seen


def _linear_with_grads(size: int) -> nn.Module:
    model = nn.Linear(size, size)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model


def test_the_call_that_makes_the_buffer_agrees_in_its_head(
    mesh: DeviceMesh, storages: list[tuple[str, int]]
) -> None:
    """Nothing else is allocated next to the buffer: a separate agreement
    tensor, even one freed before the buffer is made, can be kept a little
    longer by the process group's worker thread, and the peak would exceed
    ``max_bytes``."""
    model = _linear_with_grads(8)  # 72 fp32 elements: more than the agreement's 2 * 2 * 4 int64
    synchronize_tp_replica_gradients(model, mesh)
    (agreement_op, agreement), (data_op, data) = storages
    assert (agreement_op, data_op) == ("all_to_all_single", "all_reduce") and agreement == data


def test_a_repeated_call_agrees_in_a_tensor_of_its_own(mesh: DeviceMesh, storages: list[tuple[str, int]]) -> None:
    """Its pack writes the buffer while the agreement is in flight."""
    model = _linear_with_grads(8)
    synchronize_tp_replica_gradients(model, mesh)
    (_, buffer), _ = storages
    del storages[:]
    synchronize_tp_replica_gradients(model, mesh)
    (_, agreement), (_, data) = storages
    assert data == buffer != agreement  # the first call's buffer, kept


def test_a_buffer_smaller_than_the_agreement_is_made_after_it(
    mesh: DeviceMesh, storages: list[tuple[str, int]]
) -> None:
    model = _linear_with_grads(2)  # 6 fp32 elements and the divisor: 28 bytes
    synchronize_tp_replica_gradients(model, mesh)
    (_, agreement), (_, data) = storages
    assert data != agreement
    del storages[:]
    synchronize_tp_replica_gradients(model, mesh)
    assert storages[1][1] == data  # the buffer, kept for the next call
    assert torch.equal(model.weight.grad, torch.full((2, 2), 0.25))


def test_broadcast_agrees_in_the_head_of_the_buffer_it_makes(
    mesh: DeviceMesh, storages: list[tuple[str, int]]
) -> None:
    model = _linear_with_grads(8)
    broadcast_tp_replicas(model, mesh)
    assert [op for op, _ in storages] == ["all_to_all_single", "broadcast"]
    (_, agreement), (_, data) = storages
    assert agreement == data


def test_an_unchanged_model_keeps_its_cached_layout(mesh: DeviceMesh, storages: list[tuple[str, int]]) -> None:
    """The second call reduces in the buffer the first call's layout made:
    a rebuilt layout makes a new one (the old one is kept alive here, so
    its address cannot come back)."""
    model = _linear_with_grads(8)
    synchronize_tp_replica_gradients(model, mesh)
    (_, buffer), _ = storages
    del storages[:]
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    synchronize_tp_replica_gradients(model, mesh)
    assert storages[1] == ("all_reduce", buffer)
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


def test_buffers_shape_the_broadcast_cache_but_not_the_sync_cache(
    mesh: DeviceMesh, storages: list[tuple[str, int]]
) -> None:
    model = _linear_with_grads(8)
    synchronize_tp_replica_gradients(model, mesh)
    (_, buffer), _ = storages
    assert broadcast_tp_replicas(model, mesh) == 2
    model.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
    assert broadcast_tp_replicas(model, mesh) == 3
    del storages[:]
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 4
    synchronize_tp_replica_gradients(model, mesh)
    assert storages[1] == ("all_reduce", buffer)  # the sync's layout was kept
    assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in model.parameters())


@pytest.mark.parametrize("change", ["none", "sparse", "dtype", "shape", "type"])
def test_fast_gradient_check_agrees_with_the_per_entry_loop(mesh: DeviceMesh, change: str) -> None:
    """Whatever the gradients, the one-pass check either returns what the
    per-entry loop would (all synchronized, no deviation) or defers to it."""
    from fsdptx.tp.sync import _agreement, _layout, _ops

    model = _model()
    ctx = _layout._tp_context(mesh, "tp", None)
    assert ctx is not None
    layout = _layout._derive_layout([model], ctx, 1 << 20, "sync", False, (), True)  # the plain function
    grads = {"none": torch.ones(2, 2), "sparse": torch.ones(2, 2).to_sparse(),
             "dtype": torch.ones(2, 2, dtype=torch.float64), "shape": torch.ones(4),
             "type": nn.Parameter(torch.ones(2, 2))}
    if change in ("dtype", "shape"):  # the same parameter object, new storage (as after .data = ...)
        model.b.weight.data = torch.zeros_like(grads[change])
    model.b.weight.grad = grads[change]
    fast = _ops._common_grads(layout)
    states, got, deviations, sparse = _ops._grad_states(layout, ctx)
    if fast is not None:
        assert change == "none"
        assert all(a is b for a, b in zip(fast, got)) and not deviations and not sparse
        assert set(states) == {_agreement._SYNC}
    else:
        assert change != "none"


def test_a_non_contiguous_gradient_cut_across_chunks_is_reduced_whole_through_one_copy(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its slices go through one contiguous copy, written back at the end
    (it used to be copied again for every chunk it spans)."""
    model = nn.Linear(6, 4, bias=False)
    grad = torch.arange(24, dtype=torch.float32).reshape(6, 4).t()
    model.weight.grad = grad.clone().t().contiguous().t()  # the same values, still non-contiguous
    assert not model.weight.grad.is_contiguous()
    copies = []
    real = torch.Tensor.contiguous

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.is_contiguous():
            copies.append(self.shape)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    synchronize_tp_replica_gradients(model, mesh, max_bytes=40)  # 9 elements and the divisor per chunk
    monkeypatch.undo()
    assert torch.equal(model.weight.grad, grad / 2)
    assert copies == [torch.Size([4, 6])]
