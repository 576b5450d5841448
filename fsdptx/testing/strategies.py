"""Hypothesis strategies for random module trees and mesh shapes.

A tree is generated as immutable data (:class:`TreeSpec`) and built into an
``nn.Module`` by :func:`build_module`, optionally registering children and
tensors in a shuffled order: the same logical model built two ways is how
rank-stable ordering is tested. Requires the ``hypothesis`` package.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch
from hypothesis import strategies as st
from torch import nn

__all__ = [
    "ModuleSpec",
    "TensorSpec",
    "TreeOptions",
    "TreeSpec",
    "build_module",
    "mesh_shapes",
    "module_specs",
    "modules",
    "tree_specs",
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class ModuleSpec:
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    children: tuple[tuple[str, ModuleSpec], ...]


@dataclass(frozen=True)
class TreeSpec:
    """A module tree plus ties: each ``(alias, target)`` pair of parameter FQNs
    makes ``alias`` the same Parameter object as ``target``."""

    root: ModuleSpec
    ties: tuple[tuple[str, str], ...] = ()

    def param_fqns(self) -> list[str]:
        out: list[str] = []

        def walk(prefix: str, m: ModuleSpec) -> None:
            out.extend(f"{prefix}{p.name}" for p in m.params)
            for name, child in m.children:
                walk(f"{prefix}{name}.", child)

        walk("", self.root)
        return out


_shapes = st.one_of(
    st.tuples(st.integers(1, 6)),
    st.tuples(st.integers(1, 4), st.integers(1, 4)),
)


def _tensors(prefix: str, dtypes: Sequence[torch.dtype], max_count: int) -> st.SearchStrategy[tuple[TensorSpec, ...]]:
    return st.lists(st.tuples(_shapes, st.sampled_from(list(dtypes))), max_size=max_count).map(
        lambda items: tuple(TensorSpec(f"{prefix}{i}", s, d) for i, (s, d) in enumerate(items))
    )


def module_specs(
    *,
    max_depth: int = 3,
    max_children: int = 3,
    max_params: int = 2,
    max_buffers: int = 1,
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    buffer_dtypes: Sequence[torch.dtype] = (torch.float32, torch.int64),
) -> st.SearchStrategy[ModuleSpec]:
    """Random module trees up to ``max_depth`` levels below the root."""

    def node(depth: int) -> st.SearchStrategy[ModuleSpec]:
        kids: st.SearchStrategy[tuple[tuple[str, ModuleSpec], ...]]
        if depth >= max_depth:
            kids = st.just(())
        else:
            kids = st.lists(node(depth + 1), max_size=max_children).map(
                lambda cs: tuple((f"m{i}", c) for i, c in enumerate(cs))
            )
        return st.builds(
            ModuleSpec,
            params=_tensors("w", dtypes, max_params),
            buffers=_tensors("b", buffer_dtypes, max_buffers) if max_buffers else st.just(()),
            children=kids,
        )

    return node(0)


class TreeOptions(TypedDict, total=False):
    """The options of :func:`module_specs`, passed on by :func:`tree_specs`
    and :func:`modules` (typed, so a misspelt option is a type error)."""

    max_depth: int
    max_children: int
    max_params: int
    max_buffers: int
    dtypes: Sequence[torch.dtype]
    buffer_dtypes: Sequence[torch.dtype]


@st.composite
def tree_specs(
    draw: st.DrawFn,
    /,
    *,
    max_ties: int = 1,
    **kwargs: Unpack[TreeOptions],
) -> TreeSpec:
    """A :func:`module_specs` tree with up to ``max_ties`` tied parameter pairs
    (same shape and dtype, so the tie is a faithful alias)."""
    root = draw(module_specs(**kwargs))
    spec = TreeSpec(root)
    shapes = {f: s for f, s in zip(spec.param_fqns(), _param_specs(root))}
    ties: list[tuple[str, str]] = []
    fqns = list(shapes)
    for _ in range(draw(st.integers(0, max_ties)) if len(fqns) >= 2 else 0):
        alias, target = draw(st.permutations(fqns))[:2]
        same = (shapes[alias].shape, shapes[alias].dtype) == (shapes[target].shape, shapes[target].dtype)
        if same and all(alias not in t and target not in t for t in ties):
            ties.append((alias, target))
    return TreeSpec(root, tuple(ties))


def _param_specs(m: ModuleSpec) -> list[TensorSpec]:
    out = list(m.params)
    for _n, c in m.children:
        out.extend(_param_specs(c))
    return out


def _build(spec: ModuleSpec, rng: random.Random | None) -> nn.Module:
    module = nn.Module()
    items: list[tuple[bool, TensorSpec | tuple[str, ModuleSpec]]] = [(True, p) for p in spec.params]
    items += [(False, b) for b in spec.buffers]
    items += [(False, c) for c in spec.children]
    if rng is not None:
        rng.shuffle(items)
    for is_param, item in items:
        if isinstance(item, TensorSpec) and is_param:
            module.register_parameter(item.name, nn.Parameter(_values(item)))
        elif isinstance(item, TensorSpec):
            module.register_buffer(item.name, _values(item))
        else:
            child_name, child_spec = item
            module.add_module(child_name, _build(child_spec, rng))
    return module


def _values(t: TensorSpec) -> torch.Tensor:
    """Deterministic contents, so two builds of one spec hold equal values."""
    n = math.prod(t.shape)
    seed = sum(ord(ch) for ch in t.name) + n
    values = (torch.arange(n, dtype=torch.float64) + seed).reshape(t.shape) / 7.0
    return values.to(t.dtype)


def build_module(spec: TreeSpec, *, shuffle_seed: int | None = None) -> nn.Module:
    """Build ``spec``; with ``shuffle_seed``, register each module's children,
    parameters and buffers in a shuffled order (same FQNs, same values)."""
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    root = _build(spec.root, rng)
    for alias, target in spec.ties:
        owner_fqn, _, name = alias.rpartition(".")
        owner = root.get_submodule(owner_fqn)
        owner._parameters[name] = root.get_parameter(target)
    return root


def modules(*, max_ties: int = 1, **kwargs: Unpack[TreeOptions]) -> st.SearchStrategy[nn.Module]:
    """Built random module trees (see :func:`tree_specs` for options)."""
    return tree_specs(max_ties=max_ties, **kwargs).map(build_module)


@st.composite
def mesh_shapes(
    draw: st.DrawFn,
    *,
    names: Sequence[str] = ("dp", "tp"),
    max_world: int = 8,
    max_dim: int = 4,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, names)`` for a mesh using a non-empty ordered subset of
    ``names`` with at most ``max_world`` ranks."""
    k = draw(st.integers(1, len(names)))
    chosen = tuple(draw(st.permutations(list(names)))[:k])
    chosen = tuple(n for n in names if n in chosen)  # keep the conventional order
    shape: list[int] = []
    for _ in chosen:
        room = max_world // math.prod(shape) if shape else max_world
        shape.append(draw(st.integers(1, max(1, min(max_dim, room)))))
    return tuple(shape), chosen
