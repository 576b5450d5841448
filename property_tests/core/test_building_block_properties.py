"""Hypothesis properties of the pure building blocks: uniform-subtree maximality
and coverage, dtype grouping as a partition, chunk bounds and order, and
rank-stable tensor order."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fsdptx import (
    gradient_chunks,
    gradient_reduce_dtype,
    group_params_by_dtype,
    iter_maximal_uniform_dtype_subtrees,
    iter_unique_named_buffers,
    iter_unique_named_parameters,
)
from fsdptx.testing.strategies import TreeSpec, build_module, modules, tree_specs

PROPERTY_SETTINGS = settings(max_examples=75, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TensorPred = Callable[[torch.Tensor], bool] | None


# --- reference helpers (brute force, independent of fsdptx's traversal) ---------------


def direct_tensors(module: nn.Module, include_buffers: bool, pred: TensorPred) -> list[torch.Tensor]:
    """The tensors registered directly on ``module`` that the traversal considers."""
    out = [p for p in module._parameters.values() if p is not None]
    if include_buffers:
        out += [b for b in module._buffers.values() if b is not None]
    return [t for t in out if pred is None or pred(t)]


def subtree_dtypes(module: nn.Module, include_buffers: bool, pred: TensorPred) -> set[torch.dtype]:
    """Every considered dtype anywhere in ``module``'s subtree."""
    return {t.dtype for m in module.modules() for t in direct_tensors(m, include_buffers, pred)}


def parents_of(root: nn.Module) -> dict[int, list[nn.Module]]:
    """For every module id, all modules that register it as a child."""
    parents: dict[int, list[nn.Module]] = {}
    for m in root.modules():
        for child in m.children():
            parents.setdefault(id(child), []).append(m)
    return parents


@st.composite
def modules_with_sharing(draw: st.DrawFn) -> nn.Module:
    """Random trees in which, most of the time, one module is also registered
    under a second parent (never creating a cycle): the shape FSDP models have
    when a block is shared."""
    root: nn.Module = draw(modules(max_depth=3, max_children=3))
    non_root = list(root.modules())[1:]
    if non_root and draw(st.integers(0, 3)) > 0:
        shared = draw(st.sampled_from(non_root))
        below = {id(m) for m in shared.modules()}
        hosts = [
            m for m in root.modules() if id(m) not in below and all(c is not shared for c in m.children())
        ]
        if hosts:
            draw(st.sampled_from(hosts)).add_module("shared", shared)
    return root


# --- (1) maximality and coverage of uniform subtrees ------------------------------------


@PROPERTY_SETTINGS
@given(
    root=modules_with_sharing(),
    include_buffers=st.booleans(),
    pred=st.sampled_from([None, torch.is_floating_point]),
)
def test_uniform_subtrees_are_maximal_disjoint_and_cover_every_uniform_tensor(
    root: nn.Module, include_buffers: bool, pred: TensorPred
) -> None:
    """Yielded modules are pairwise non-nested; each yielded subtree carries
    exactly the yielded dtype; no yielded module has a parent whose subtree is
    uniform; and every considered tensor slot (module, tensor) lies in exactly
    one yielded subtree when its module's subtree is uniform, in none when it
    is mixed (at least one when a module on its path is registered under two
    parents, since two disjoint uniform subtrees can then share it)."""
    items = list(
        iter_maximal_uniform_dtype_subtrees(root, include_buffers=include_buffers, tensor_pred=pred, return_paths=True)
    )
    yielded = [m for _fqn, m, _d in items]
    dtypes = {id(m): subtree_dtypes(m, include_buffers, pred) for m in root.modules()}
    members = {id(m): {id(d) for d in m.modules()} for m in yielded}

    assert len(members) == len(yielded), "a module was yielded twice"
    for a in yielded:
        for b in yielded:
            if a is not b:
                assert id(a) not in members[id(b)], "a yielded module lies inside another"

    parents = parents_of(root)
    for fqn, module, dtype in items:
        assert root.get_submodule(fqn) is module
        assert dtypes[id(module)] == {dtype}
        for parent in parents.get(id(module), []):
            assert len(dtypes[id(parent)]) > 1, f"{fqn!r} is not maximal"

    for module in root.modules():
        if not direct_tensors(module, include_buffers, pred):
            continue
        holders = sum(id(module) in ids for ids in members.values())
        if len(dtypes[id(module)]) > 1:
            assert holders == 0
        elif any(len(parents.get(id(m), [])) > 1 for m in [module, *ancestors(module, parents)]):
            # Reachable along two paths: two disjoint uniform subtrees may both
            # contain it, and neither can be yielded without it.
            assert holders >= 1
        else:
            assert holders == 1


def ancestors(module: nn.Module, parents: dict[int, list[nn.Module]]) -> list[nn.Module]:
    """Every module above ``module`` along any path."""
    out: list[nn.Module] = []
    stack = list(parents.get(id(module), []))
    while stack:
        m = stack.pop()
        if all(m is not o for o in out):
            out.append(m)
            stack.extend(parents.get(id(m), []))
    return out


# --- (2) grouping is a partition --------------------------------------------------------


@PROPERTY_SETTINGS
@given(root=modules(max_depth=2, max_ties=2), data=st.data())
def test_group_params_by_dtype_partitions_the_distinct_parameters(root: nn.Module, data: st.DataObject) -> None:
    """The groups are non-empty, pairwise disjoint, list each parameter once,
    hold only parameters whose key is the group's key, and together are exactly
    the module's distinct parameters minus ``ignored_params``."""
    distinct = list(root.parameters())
    ignored = data.draw(st.sets(st.sampled_from(distinct)) if distinct else st.just(set()))
    ignored_ids = {id(p) for p in ignored}

    groups = group_params_by_dtype(root, ignored_params=ignored)

    members = [p for group in groups.values() for p in group]
    assert all(groups.values())
    assert len({id(p) for p in members}) == len(members)
    assert {id(p) for p in members} == {id(p) for p in distinct} - ignored_ids
    for key, group in groups.items():
        assert all(p.dtype == key for p in group)


# --- (3) chunk bounds and order -----------------------------------------------------------

CHUNK_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8]
FOUR_BYTE_COMM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def tensor_lists(draw: st.DrawFn, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Contiguous, non-empty tensors with distinct small values (exact in every dtype)."""
    out: list[torch.Tensor] = []
    counter = 0
    for _ in range(draw(st.integers(0, 6))):
        shape = draw(st.sampled_from([(1,), (5,), (3, 4), (2, 1, 3), (17,)]))
        n = math.prod(shape)
        values = (torch.arange(n, dtype=torch.float64) + counter) % 100
        counter += n
        out.append(values.reshape(shape).to(draw(st.sampled_from(dtypes))))
    return out


def comm_itemsize(t: torch.Tensor) -> int:
    return gradient_reduce_dtype(t.dtype).itemsize


def budget(chunk: list[torch.Tensor]) -> int:
    return sum(t.numel() * comm_itemsize(t) for t in chunk)


def flat_elements(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.dtype]]:
    """All elements in order as float64, plus each element's dtype."""
    pieces = list(tensors)
    if not pieces:
        return torch.zeros(0, dtype=torch.float64), []
    values = torch.cat([t.reshape(-1).to(torch.float64) for t in pieces])
    dtypes = [t.dtype for t in pieces for _ in range(t.numel())]
    return values, dtypes


@PROPERTY_SETTINGS
@given(tensors=tensor_lists(CHUNK_DTYPES), max_bytes=st.integers(8, 160))
def test_gradient_chunks_are_bounded_full_and_preserve_order(tensors: list[torch.Tensor], max_bytes: int) -> None:
    """Every chunk is a non-empty list whose communication budget is at most
    ``max_bytes``; a chunk is closed only when the next element no longer
    fits; and the pieces, flattened in order, are exactly the inputs flattened
    in order (same values, same dtypes)."""
    chunks = list(gradient_chunks(tensors, max_bytes=max_bytes))

    for chunk in chunks:
        assert chunk, "empty chunk"
        assert 0 < budget(chunk) <= max_bytes
    for chunk, following in zip(chunks, chunks[1:]):
        assert max_bytes - budget(chunk) < comm_itemsize(following[0]), "chunk closed while not full"

    got_values, got_dtypes = flat_elements(p for chunk in chunks for p in chunk)
    want_values, want_dtypes = flat_elements(tensors)
    assert torch.equal(got_values, want_values)
    assert got_dtypes == want_dtypes


@PROPERTY_SETTINGS
@given(tensors=tensor_lists(FOUR_BYTE_COMM_DTYPES), slots=st.integers(1, 40))
def test_gradient_chunk_count_is_the_least_the_budget_allows(tensors: list[torch.Tensor], slots: int) -> None:
    """When every input is communicated at the same itemsize (here 4 bytes:
    fp32, or bf16/fp16 reduced in fp32) and ``max_bytes`` is a multiple of it,
    the number of chunks is ceil(total budget / max_bytes)."""
    max_bytes = 4 * slots
    total = sum(t.numel() * 4 for t in tensors)

    chunks = list(gradient_chunks(tensors, max_bytes=max_bytes))

    assert len(chunks) == math.ceil(total / max_bytes)


@PROPERTY_SETTINGS
@given(tensors=tensor_lists(CHUNK_DTYPES), max_bytes=st.integers(8, 160))
def test_gradient_chunks_yield_whole_inputs_as_themselves_and_cut_ones_as_views(
    tensors: list[torch.Tensor], max_bytes: int
) -> None:
    """Each piece is either an input tensor itself or a flat view sharing its
    storage, so writing reduced values into the pieces writes into the inputs."""
    storages = {t.untyped_storage().data_ptr() for t in tensors}

    for chunk in gradient_chunks(tensors, max_bytes=max_bytes):
        for piece in chunk:
            assert any(piece is t for t in tensors) or (
                piece.dim() == 1 and piece.untyped_storage().data_ptr() in storages
            )


# --- (4) rank-stable order ------------------------------------------------------------------


def snapshot(pairs: Iterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.dtype, tuple[int, ...], list[float]]]:
    return [(fqn, t.dtype, tuple(t.shape), t.detach().to(torch.float64).reshape(-1).tolist()) for fqn, t in pairs]


@PROPERTY_SETTINGS
@given(
    specs=st.lists(tree_specs(max_depth=2, max_ties=2), min_size=1, max_size=2),
    seeds=st.tuples(st.integers(0, 2**16), st.integers(0, 2**16)).filter(lambda s: s[0] != s[1]),
)
def test_unique_named_tensors_do_not_depend_on_registration_order(
    specs: list[TreeSpec], seeds: tuple[int, int]
) -> None:
    """Building the same model parts with two different registration orders
    yields the same (fqn, dtype, shape, values) sequence of parameters and of
    buffers, sorted by (part index, fqn) with each tied parameter once under
    its smallest FQN."""
    first = [build_module(spec, shuffle_seed=seeds[0]) for spec in specs]
    second = [build_module(spec, shuffle_seed=seeds[1]) for spec in specs]

    params = snapshot(iter_unique_named_parameters(first))
    assert params == snapshot(iter_unique_named_parameters(second))
    assert snapshot(iter_unique_named_buffers(first)) == snapshot(iter_unique_named_buffers(second))

    part_fqns = [[fqn for fqn, _ in iter_unique_named_parameters(part)] for part in first]
    assert [fqn for fqn, *_ in params] == [fqn for fqns in part_fqns for fqn in fqns]
    for spec, fqns in zip(specs, part_fqns):
        hidden = {max(alias, target) for alias, target in spec.ties}
        assert fqns == sorted(f for f in spec.param_fqns() if f not in hidden)
