"""TP peers that disagree on anything shaping the collectives, on 2 real
gloo ranks forming one TP group.

One spawn runs every scenario in turn and reports, per rank, what each call
raised, how long it took, and whether any gradient or tensor changed; a
final clean sync proves no rank was left inside a collective. The gloo
timeout is seconds, not minutes, so a rank left waiting would fail the run
rather than hang it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptx import broadcast_tp_replicas, mark_tp_replica_gradient_reduction, synchronize_tp_replica_gradients
from fsdptx.testing import run_distributed

WORLD = 2
COLLECTIVE_TIMEOUT_S = 15.0
SPAWN_TIMEOUT_S = 300.0  # start-up included: minutes on a loaded CI machine
# Half the gloo timeout: an error this fast was raised, not waited for, with
# room for a loaded machine's pauses (a few seconds on 2 shared cores).
ERROR_BOUND_S = COLLECTIVE_TIMEOUT_S / 2


def _model(rank: int, *, shape: tuple[int, int] = (2, 3), sum_a: bool = False) -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(3, 2)
    model.w = nn.Parameter(torch.zeros(shape))
    model.register_buffer("steps", torch.full((3,), rank, dtype=torch.int64))
    if sum_a:
        mark_tp_replica_gradient_reduction(model.a, "sum")
    for i, p in enumerate(model.parameters()):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
        with torch.no_grad():
            p.copy_(p.grad * 10)
    return model


def _mixed(rank: int) -> nn.Module:
    model = _model(rank)
    model.d = nn.Linear(2, 2, dtype=torch.float64)
    for p in model.d.parameters():
        p.grad = torch.ones_like(p) * (rank + 1)
    return model


def _state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {
        f"grad:{n}": None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
        for n, p in model.named_parameters()
    }
    out.update({n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]})
    return out


def _attempt(model: nn.Module, call: Callable[[nn.Module], object]) -> dict[str, Any]:
    before = _state(model)
    start = time.monotonic()
    try:
        call(model)
        error: tuple[str, str] | None = None
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        error = (type(e).__name__, str(e))
    after = _state(model)
    unchanged = before.keys() == after.keys() and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((before[k], after[k]) for k in before)
    )
    return {"error": error, "elapsed": time.monotonic() - start, "unchanged": unchanged}


def _scenarios(rank: int, mesh: DeviceMesh) -> dict[str, dict[str, Any]]:
    sync = functools.partial(synchronize_tp_replica_gradients, device_mesh=mesh)
    bcast = functools.partial(broadcast_tp_replicas, device_mesh=mesh)
    out: dict[str, dict[str, Any]] = {}
    # 1. max_bytes differs: chunk sizes would differ
    out["max_bytes"] = _attempt(_model(rank), lambda m: sync(m, max_bytes=64 if rank == 0 else 128))
    # 2. marks differ: sum on one rank, mean on the other
    out["marks"] = _attempt(_model(rank, sum_a=rank == 0), lambda m: sync(m))
    # 3. same element count, different shapes
    out["shapes"] = _attempt(_model(rank, shape=(2, 3) if rank == 0 else (3, 2)), lambda m: sync(m))
    # 4. broadcast: dtype, max_bytes, an extra buffer
    other_dtype = _model(rank)
    if rank == 1:
        other_dtype.steps = other_dtype.steps.to(torch.int32)
    out["b_dtype"] = _attempt(other_dtype, lambda m: bcast(m))
    out["b_max_bytes"] = _attempt(_model(rank), lambda m: bcast(m, max_bytes=16 if rank == 0 else 4096))
    extra = _model(rank)
    if rank == 1:
        extra.register_buffer("extra", torch.zeros(4))
    out["b_extra"] = _attempt(extra, lambda m: bcast(m))
    # 5. invalid arguments on every rank: raise before any collective (fp32
    # grads come first; they used to be reduced before the fp64 ones failed)
    out["invalid_4"] = _attempt(_mixed(rank), lambda m: sync(m, max_bytes=4))
    out["invalid_float"] = _attempt(_mixed(rank), lambda m: sync(m, max_bytes=10.5))
    # 6. the same, once a first call succeeded on both ranks: rank 0 repeats
    # its call with its cached, materialized plan (it packs its buffer while
    # the agreement is in flight), rank 1 changes what it would send
    for case, change in (("cached_presence", "presence"), ("cached_sparse", "sparse"),
                         ("cached_max_bytes", "max_bytes"), ("cached_marks", "marks")):
        model = _model(rank)
        sync(model)
        for i, p in enumerate(model.parameters()):
            p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
        max_bytes = 256 * 2**20
        if rank == 1:
            if change == "presence":
                model.a.bias.grad = None
            elif change == "sparse":
                model.a.bias.grad = model.a.bias.grad.to_sparse()  # type: ignore[union-attr]
            elif change == "max_bytes":
                max_bytes = 4096
            else:
                mark_tp_replica_gradient_reduction(model.a, "sum")
        out[case] = _attempt(model, lambda m, b=max_bytes: sync(m, max_bytes=b))
    # 7. a parameter changed in place after a first call (same Parameter
    # object, new dtype or shape): the cached layout and buffer must not
    # stand in for it, so the peers see the difference and refuse together
    for case, change in (("cached_b_cast", "cast"), ("cached_b_data_shape", "data")):
        model = _model(rank)
        bcast(model)
        if rank == 1:
            if change == "cast":
                model.double()
            else:
                model.w.data = torch.zeros(3, 2)
        out[case] = _attempt(model, lambda m: bcast(m))
    # 8. both ranks cast after a first call, and only rank 1 rebuilds its
    # layout for another reason (a parameter-free submodule): both layouts
    # describe fp64 parameters, so the peers agree and reduce
    model = _model(rank)
    sync(model)
    model.double()
    if rank == 1:
        model.extra = nn.Identity()
    for i, p in enumerate(model.parameters()):
        p.grad = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * (rank + 1) + i
    out["cast_both"] = _attempt(model, lambda m: sync(m))
    out["cast_both"]["w"] = model.w.grad.clone()  # type: ignore[union-attr]
    # the group is still usable: a clean sync reduces exactly
    clean = _model(rank)
    out["clean"] = _attempt(clean, lambda m: sync(m))
    out["clean"]["grads"] = {n: p.grad.clone() for n, p in clean.named_parameters()}  # type: ignore[union-attr]
    return out


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return _scenarios(rank, mesh)


@functools.cache
def _results() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_worker, WORLD, timeout_s=SPAWN_TIMEOUT_S, collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.mark.parametrize(
    ("case", "kind", "needles"),
    [
        ("max_bytes", "RuntimeError", ("max_bytes", "rank 0: 64", "rank 1: 128")),
        ("marks", "RuntimeError", ("a.weight", "a.bias", "sum", "mean")),
        ("shapes", "RuntimeError", ("w:", "(2, 3)", "(3, 2)")),
        ("b_dtype", "RuntimeError", ("steps", "int64", "int32")),
        ("b_max_bytes", "RuntimeError", ("max_bytes",)),
        ("b_extra", "RuntimeError", ("extra", "absent")),
        ("invalid_4", "ValueError", ("max_bytes=4",)),
        ("invalid_float", "TypeError", ("max_bytes",)),
        ("cached_presence", "RuntimeError", ("presence differs", "a.bias")),
        ("cached_sparse", "RuntimeError", ("sparse", "a.bias")),
        ("cached_max_bytes", "RuntimeError", ("max_bytes", "rank 1: 4096")),
        ("cached_marks", "RuntimeError", ("a.weight", "sum", "mean")),
        ("cached_b_cast", "RuntimeError", ("a.weight", "float32", "float64")),
        ("cached_b_data_shape", "RuntimeError", ("w:", "(2, 3)", "(3, 2)")),
    ],
)
def test_disagreement_or_bad_argument_raises_on_every_rank_changing_nothing(
    case: str, kind: str, needles: tuple[str, ...]
) -> None:
    results = _results()
    messages = []
    for rank in range(WORLD):
        outcome = results[rank][case]
        assert outcome["error"] is not None, f"rank {rank} did not raise for {case}"
        got_kind, message = outcome["error"]
        assert got_kind == kind, (rank, case, got_kind, message)
        assert all(n in message for n in needles), (rank, case, message)
        assert outcome["unchanged"], f"rank {rank}: {case} modified a gradient or tensor"
        assert outcome["elapsed"] < ERROR_BOUND_S, (rank, case, outcome["elapsed"])
        messages.append(message)
    if kind == "RuntimeError":
        assert len(set(messages)) == 1, "every peer raises the same message"


def test_group_stays_usable_after_every_refused_call() -> None:
    results = _results()
    for rank in range(WORLD):
        assert results[rank]["clean"]["error"] is None
    a, b = (results[r]["clean"]["grads"] for r in range(WORLD))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # w is the first parameter (i = 0): the mean of x*1 and x*2
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(a["w"], w * 1.5)


def test_peers_that_all_cast_after_a_cached_call_agree_whichever_rebuilt_its_layout() -> None:
    """The layout digest describes the parameters as they are now, not as
    they were when one rank cached it."""
    results = _results()
    w = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    for rank in range(WORLD):
        assert results[rank]["cast_both"]["error"] is None, results[rank]["cast_both"]["error"]
        assert torch.equal(results[rank]["cast_both"]["w"], w * 1.5)
