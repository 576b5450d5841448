"""Module-tree traversal: uniform-dtype subtrees, dotted paths, rank-stable tensor order.

Everything here is pure: it reads ``nn.Module`` structure and never mutates it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from typing import Any, Literal, TypeVar, cast, overload

import torch
from torch import nn

from ._args import require_bool, require_callable, require_module, require_modules

__all__ = [
    "get_module_from_path",
    "iter_maximal_uniform_dtype_subtrees",
    "iter_unique_named_buffers",
    "iter_unique_named_parameters",
    "join_fqn",
]

UniformSubtreeItem = tuple[nn.Module, torch.dtype] | tuple[str, nn.Module, torch.dtype]

# Subtree states: a key (uniform), _EMPTY (no tensor considered) or _MIXED.
_EMPTY = object()
_MIXED = object()


def join_fqn(prefix: str, name: str) -> str:
    """Join a module FQN and a child name; the root's FQN is ``""``."""
    return f"{prefix}.{name}" if prefix else name


def _direct_tensors(module: nn.Module, include_buffers: bool) -> Iterator[torch.Tensor]:
    for p in module._parameters.values():
        if p is not None:
            yield p
    if include_buffers:
        for b in module._buffers.values():
            if b is not None:
                yield b


def subtree_keys(
    root: nn.Module,
    key_of: Callable[[nn.Module], Iterable[Hashable]],
    stop: Collection[int] = (),
) -> tuple[dict[int, object], bool]:
    """Summarise every module's subtree as one key, ``_EMPTY`` or ``_MIXED``;
    also say whether some module is registered under two parents.

    An iterative post-order walk combines each module once from its direct
    keys and its children's summaries: linear in modules plus tensors. A module
    registered under two parents is summarised once and its summary reused by
    the second parent. Modules whose id is in ``stop`` (other than ``root``)
    count as empty and are not entered: the planner passes the modules already
    planned as units. No FQN is built here; only the (short) descent in
    :func:`maximal_uniform_subtrees` needs names.
    """
    state: dict[int, object] = {}
    shared = False
    stack: list[tuple[nn.Module, bool]] = [(root, False)]
    while stack:
        module, expanded = stack.pop()
        mid = id(module)
        if mid in state:
            shared = True
            continue
        if module is not root and mid in stop:
            state[mid] = _EMPTY
            continue
        children = module._modules
        if not expanded:
            stack.append((module, True))
            for child in children.values():
                if child is None:
                    continue
                if id(child) in state:
                    shared = True
                else:
                    stack.append((child, False))
            continue
        acc: object = _EMPTY
        for key in key_of(module):
            acc = _merge(acc, key)
            if acc is _MIXED:
                break
        if acc is not _MIXED:
            for child in children.values():
                if child is not None:
                    acc = _merge(acc, state[id(child)])
                    if acc is _MIXED:
                        break
        state[mid] = acc
    return state, shared


def _merge(acc: object, key: object) -> object:
    if key is _EMPTY or acc is _MIXED:
        return acc
    if acc is _EMPTY or key is _MIXED:
        return key
    return acc if acc == key else _MIXED


_Key = TypeVar("_Key", bound=Hashable)


def maximal_uniform_subtrees(
    root: nn.Module,
    key_of: Callable[[nn.Module], Iterable[_Key]],
    prefix: str = "",
    stop: Collection[int] = (),
) -> Iterator[tuple[str, nn.Module, _Key]]:
    """Yield maximal ``(fqn, module, key)`` whose subtree carries exactly one key.

    The generic engine behind :func:`iter_maximal_uniform_dtype_subtrees` and
    the dtype planner: ``key_of(module)`` gives the keys of a module's own
    tensors, so callers choose what counts (storage dtype, the
    (storage, compute) pair, parameters owned elsewhere left out).

    A module registered under two parents, one uniform and one mixed, is
    reached through the mixed one as a candidate of its own although it also
    lies inside the uniform one; such candidates are dropped, so no yielded
    module is a strict descendant of another.
    """
    state, shared = subtree_keys(root, key_of, stop)
    candidates: list[tuple[str, nn.Module, _Key]] = []
    stack: list[tuple[str, nn.Module]] = [(prefix, root)]
    seen: set[int] = set()
    while stack:
        fqn, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        s = state[id(module)]
        if s is _EMPTY:
            continue
        if s is not _MIXED:
            # Neither sentinel: one of key_of's keys (the state table is
            # typed object only because it also holds the sentinels).
            candidates.append((fqn, module, cast(_Key, s)))
            continue
        children = [(join_fqn(fqn, n), c) for n, c in module._modules.items() if c is not None]
        stack.extend(reversed(children))
    if not shared:
        yield from candidates
        return
    covered = _strict_descendants([m for _, m, _ in candidates], stop)
    for fqn, module, key in candidates:
        if id(module) not in covered:
            yield fqn, module, key


def _strict_descendants(tops: Iterable[nn.Module], stop: Collection[int]) -> set[int]:
    """Ids of every module strictly below one of ``tops`` (``stop`` modules
    are not entered); each module is expanded once, so linear overall."""
    covered: set[int] = set()
    expanded: set[int] = set()
    stack = list(tops)
    while stack:
        module = stack.pop()
        if id(module) in expanded:
            continue
        expanded.add(id(module))
        for child in module._modules.values():
            if child is not None:
                covered.add(id(child))
                if id(child) not in stop:
                    stack.append(child)
    return covered


@overload
def iter_maximal_uniform_dtype_subtrees(
    module: nn.Module,
    *,
    include_buffers: bool = ...,
    tensor_pred: Callable[[torch.Tensor], bool] | None = ...,
    dtype_of: Callable[[torch.Tensor], torch.dtype] | None = ...,
    return_paths: Literal[False] = ...,
) -> Iterator[tuple[nn.Module, torch.dtype]]: ...


@overload
def iter_maximal_uniform_dtype_subtrees(
    module: nn.Module,
    *,
    include_buffers: bool = ...,
    tensor_pred: Callable[[torch.Tensor], bool] | None = ...,
    dtype_of: Callable[[torch.Tensor], torch.dtype] | None = ...,
    return_paths: Literal[True],
) -> Iterator[tuple[str, nn.Module, torch.dtype]]: ...


def iter_maximal_uniform_dtype_subtrees(
    module: nn.Module,
    *,
    include_buffers: bool = True,
    tensor_pred: Callable[[torch.Tensor], bool] | None = None,
    dtype_of: Callable[[torch.Tensor], torch.dtype] | None = None,
    return_paths: bool = False,
) -> Iterator[UniformSubtreeItem]:
    """Yield the maximal submodules whose whole subtree has exactly one dtype.

    These are the largest pieces FSDP2 can shard as one unit without tripping
    its uniform-dtype assertion. A subtree with no tensor passing
    ``tensor_pred`` is skipped (it constrains nothing); no yielded module is a
    strict descendant of another. ``dtype_of`` lets callers unify on compute
    dtype instead of storage dtype. Order is registration order; one pass.
    A module registered under two parents can lie inside two yielded
    subtrees that are not nested (neither can be yielded without it).

    Args:
        module: the root of the walk (yielded itself when uniform).
        include_buffers: whether buffers count as well as parameters.
        tensor_pred: which tensors count; all by default.
        dtype_of: the dtype of a tensor; its storage dtype by default.
        return_paths: yield ``(fqn, module, dtype)`` (``""`` for the root)
            instead of ``(module, dtype)``.

    Yields:
        ``(module, dtype)``, or ``(fqn, module, dtype)`` with
        ``return_paths=True``, in registration order.

    Raises:
        TypeError: an argument of the wrong type (at the call, not at the
            first ``next()``).

    Example::

        for fqn, sub, dtype in fsdptx.iter_maximal_uniform_dtype_subtrees(block, return_paths=True):
            print(fqn or "<root>", dtype)
    """
    where = "iter_maximal_uniform_dtype_subtrees"
    require_module(module, "module", where)
    require_bool(include_buffers, "include_buffers", where)
    require_callable(tensor_pred, "tensor_pred", where, optional=True)
    dtype_fn: Callable[[torch.Tensor], torch.dtype] = require_callable(dtype_of, "dtype_of", where, optional=True) or (
        lambda t: t.dtype
    )
    require_bool(return_paths, "return_paths", where)
    # Checked at the call; the walk itself runs as the caller iterates.
    return _uniform_subtrees(module, include_buffers, tensor_pred, dtype_fn, return_paths)


def _uniform_subtrees(
    module: nn.Module,
    include_buffers: bool,
    tensor_pred: Callable[[torch.Tensor], bool] | None,
    dtype_fn: Callable[[torch.Tensor], torch.dtype],
    return_paths: bool,
) -> Iterator[UniformSubtreeItem]:
    """:func:`iter_maximal_uniform_dtype_subtrees` once its arguments are checked."""

    def key_of(m: nn.Module) -> Iterator[torch.dtype]:
        for t in _direct_tensors(m, include_buffers):
            if tensor_pred is None or tensor_pred(t):
                yield dtype_fn(t)

    for fqn, sub, dtype in maximal_uniform_subtrees(module, key_of):
        yield (fqn, sub, dtype) if return_paths else (sub, dtype)


def get_module_from_path(root: nn.Module, path: str) -> nn.Module:
    """Resolve a dotted FQN (``"layers.3.attn"``; ``""`` is ``root``).

    Raises ``AttributeError`` naming the full path and the first unknown
    segment, so a typo in a plan or a model's declared names is obvious.

    Args:
        root: the module the path starts from.
        path: a dotted FQN; ``nn.ModuleList`` indices are segments.

    Returns:
        The submodule.

    Raises:
        TypeError: ``root`` is not a module or ``path`` not a str.
        AttributeError: a segment names no submodule.

    Example::

        attn = fsdptx.get_module_from_path(model, "layers.3.attn")
    """
    require_module(root, "root", "get_module_from_path")
    if not isinstance(path, str):
        raise TypeError(f"get_module_from_path: path must be a dotted str, got {type(path).__name__}")
    module = root
    if not path:
        return module
    walked: list[str] = []
    for segment in path.split("."):
        child = module._modules.get(segment)
        if child is None:
            known = ", ".join(repr(k) for k in module._modules) or "none"
            where = ".".join(walked) or "<root>"
            raise AttributeError(
                f"module path {path!r}: {where} ({type(module).__name__}) has no submodule "
                f"{segment!r}; its submodules are: {known}"
            )
        walked.append(segment)
        module = child
    return module


Entry = TypeVar("Entry", bound=tuple[Any, ...])


def rank_stable_unique(entries: list[Entry]) -> list[Entry]:
    """Sort ``(part index, fqn, tensor, ...)`` entries by (part index, FQN as a
    plain string) and keep each distinct tensor once, under its smallest FQN.

    The one definition of "rank-stable order" in fsdptx: whatever the
    registration order or object identities on a rank, the same logical model
    gives the same sequence, so collectives issued in it match across ranks.
    """
    entries.sort(key=lambda e: (e[0], e[1]))
    seen: set[int] = set()
    out: list[Entry] = []
    for e in entries:
        if id(e[2]) not in seen:
            seen.add(id(e[2]))
            out.append(e)
    return out


_Tensor = TypeVar("_Tensor", bound=torch.Tensor)


def _iter_unique_named(
    parts: list[nn.Module],
    named: Callable[[nn.Module], Iterable[tuple[str, _Tensor]]],
) -> Iterator[tuple[str, _Tensor]]:
    """The tensors of ``parts`` (checked by the public caller), each once."""
    entries = [(index, fqn, t) for index, part in enumerate(parts) for fqn, t in named(part)]
    for _, fqn, tensor in rank_stable_unique(entries):
        yield fqn, tensor


def iter_unique_named_parameters(
    model_parts: Sequence[nn.Module] | nn.Module,
) -> Iterator[tuple[str, nn.Parameter]]:
    """Yield ``(fqn, param)`` once per distinct parameter in rank-stable order.

    Collectives must be issued in the same order on every rank. Registration
    order and object identity can differ between ranks that built the same
    logical model differently, so the order is (part index, FQN as a plain
    string); a tied parameter appears once, under its smallest FQN.

    Args:
        model_parts: one module, or the model parts this rank holds (a
            pipeline stage's chunks), in the same order on every rank.

    Yields:
        ``(fqn, parameter)``, each distinct parameter once.

    Raises:
        TypeError: a part is not an ``nn.Module``.

    Example::

        for fqn, p in fsdptx.iter_unique_named_parameters([model]):
            ...  # the same order on every rank
    """
    parts = require_modules(model_parts, "model_parts", "iter_unique_named_parameters")
    return _iter_unique_named(parts, lambda m: m.named_parameters(remove_duplicate=False))


def iter_unique_named_buffers(
    model_parts: Sequence[nn.Module] | nn.Module,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(fqn, buffer)`` once per distinct buffer, in the same rank-stable
    order as :func:`iter_unique_named_parameters` (persistent or not).

    Args:
        model_parts: one module, or the model parts this rank holds.

    Yields:
        ``(fqn, buffer)``, each distinct buffer once.

    Raises:
        TypeError: a part is not an ``nn.Module``.

    Example::

        names = [fqn for fqn, _ in fsdptx.iter_unique_named_buffers(model)]
    """
    parts = require_modules(model_parts, "model_parts", "iter_unique_named_buffers")
    return _iter_unique_named(parts, lambda m: m.named_buffers(remove_duplicate=False))
