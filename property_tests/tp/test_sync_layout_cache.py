"""The TP-replica sync, broadcast and audit give the same results with their
layout cache on and off.

The cache (on by default) keeps each operation's layout on the model and
re-derives it only when the model, its marks or the mesh changed;
``fsdptx.caches(enabled=False)`` derives it afresh on every call and stores nothing.
Random module trees go through a random sequence of changes between calls
(marks, exclusions, a cast, a parameter added or removed, new gradients);
after each change, the cached run and the plain run must agree on what was
synchronized, broadcast and audited, and on every resulting gradient.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import fsdptx
from fsdptx.testing import fake_mesh
from fsdptx.testing.strategies import modules


def _grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _mark(model: nn.Module, index: int) -> None:
    mods = list(model.modules())
    fsdptx.mark_tp_replica_gradient_reduction(mods[index % len(mods)], "sum")


def _exclude(model: nn.Module, index: int) -> None:
    mods = list(model.modules())
    fsdptx.exclude_from_tp_replica_sync(mods[index % len(mods)])


def _cast(model: nn.Module, index: int) -> None:
    params = list(model.parameters())
    if params:
        p = params[index % len(params)]
        p.data = p.data.double()


def _add(model: nn.Module, index: int) -> None:
    mods = list(model.modules())
    mods[index % len(mods)].register_parameter(f"added{index}", nn.Parameter(torch.ones(3)))


def _remove(model: nn.Module, index: int) -> None:
    for m in model.modules():
        if m._parameters:
            del m._parameters[next(iter(m._parameters))]
            return


CHANGES: dict[str, Callable[[nn.Module, int], None]] = {
    "mark": _mark,
    "exclude": _exclude,
    "cast": _cast,
    "add": _add,
    "remove": _remove,
    "nothing": lambda model, index: None,
}


def _observe(model: nn.Module, mesh: object, seed: int) -> tuple[object, ...]:
    """One round of every operation; what each one returned or changed."""
    _grads(model, seed)
    synced = fsdptx.synchronize_tp_replica_gradients([model], mesh)  # type: ignore[arg-type]
    grads = [(n, None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()]
    broadcast = fsdptx.broadcast_tp_replicas([model], mesh)  # type: ignore[arg-type]
    audit = fsdptx.audit_replicas([model], mesh, buffers=True)  # type: ignore[arg-type]
    return synced, broadcast, audit, grads


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    *head_a, grads_a = a
    *head_b, grads_b = b
    return head_a == head_b and all(
        na == nb and (ga is None and gb is None or ga is not None and gb is not None and torch.equal(ga, gb))
        for (na, ga), (nb, gb) in zip(grads_a, grads_b, strict=True)  # type: ignore[call-overload]
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    model=modules(max_depth=2, max_children=2),
    changes=st.lists(st.tuples(st.sampled_from(sorted(CHANGES)), st.integers(0, 20)), min_size=1, max_size=4),
)
def test_every_operation_gives_the_same_result_with_the_layout_cache_on_and_off(
    model: nn.Module, changes: list[tuple[str, int]]
) -> None:
    cached, plain, untouched = model, copy.deepcopy(model), copy.deepcopy(model)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        for step, (change, index) in enumerate([("nothing", 0), *changes]):
            CHANGES[change](cached, index)
            CHANGES[change](plain, index)
            CHANGES[change](untouched, index)  # changed alike, never synchronized
            with_cache = _observe(cached, mesh, step)
            with fsdptx.caches(enabled=False):
                without = _observe(plain, mesh, step)
            assert _same(with_cache, without), f"after {change} {index}"
    assert _attributes(plain) == _attributes(untouched), "the plain path stored something on the model"


def _attributes(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Each module's instance attribute names: what a cache kept on the model would add to."""
    return [(f, sorted(vars(m))) for f, m in model.named_modules()]

