"""The residual stream of a model, as the sequence-layout pass
(:mod:`fsdptx.tp._layout`) walks it: where the sequence enters (the input
embedding) and leaves (the output head), the stack of blocks the plan
parallelizes, the backbone's modules before and after it, and the modules
beside the blocks that a ``blocks=`` naming only some of them leaves out.
Pure: it reads the model through the planner's index."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from ..model._gap import StageGap
from ..model._index import ModelIndex, unwrap_checkpoint

__all__ = ["input_embedding", "output_head", "output_head_module"]


@dataclass(frozen=True)
class _Stream:
    """The modules on the residual stream, in forward order."""

    pre: tuple[str, ...]  # the backbone's modules before the stack (the embedding among them)
    embedding: str | None
    blocks: tuple[str, ...]
    post: tuple[str, ...]  # the backbone's modules after the stack, the head excluded
    head: str | None
    # Modules beside the blocks that the stack runs too but blocks= leaves
    # out: a container's other children, a root-level stack's modules
    # between its first and last block or of a block's class.
    left_out: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        model: nn.Module,
        index: ModelIndex,
        declared: Mapping[str, object],
        blocks: tuple[str, ...],
        sequence_parallel: bool,
    ) -> _Stream:
        head = output_head(model, index)
        if head is not None and isinstance(index.modules.get(head), StageGap):
            head = None  # a pipeline stage before the last: the head is another stage's
        stacks: dict[str, list[str]] = {}
        for b in blocks:
            stacks.setdefault(b.rpartition(".")[0], []).append(b)
        # The stack the plan parallelizes; under SP without TP in any block
        # (a plan of embedding and head only), the largest one.
        with_tp = [s for s, bs in stacks.items() if any(_inside(f, b) for b in bs for f in declared)]
        chosen = with_tp or (sorted(stacks, key=lambda s: -len(stacks[s]))[:1] if sequence_parallel else [])
        if not chosen:
            return cls((), None, (), (), head)
        container = max(chosen, key=lambda s: len(stacks[s]))
        stack = tuple(stacks[container])
        # The backbone holds the stack beside the modules before and after it;
        # blocks registered on the root directly are their own stack.
        backbone, _, leaf = container.rpartition(".") if container else ("", "", "")
        owner = index.modules.get(backbone, model)
        full = [f"{backbone}.{n}" if backbone else n for n, c in owner._modules.items() if c is not None]
        if container:
            first = last = full.index(container) if container in full else len(full)
            held = index.modules[container]._modules.items()
            siblings = [f"{container}.{n}" for n, c in held if c is not None]
            left_out = [f for f in siblings if f not in stack and _holds_params(index, f)]
        else:
            at = [i for i, f in enumerate(full) if f in stack]
            first, last = (min(at), max(at)) if at else (len(full), len(full))
            kinds = {type(unwrap_checkpoint(index.modules[b])) for b in stack}
            left_out = [
                f for i, f in enumerate(full) if f not in stack and _holds_params(index, f)
                and (first < i < last or type(unwrap_checkpoint(index.modules[f])) in kinds)
            ]
        pre = tuple(f for f in full[:first] if _holds_params(index, f) and f not in left_out)
        post = tuple(f for f in full[last + 1 :] if f != head and _holds_params(index, f) and f not in left_out)
        return cls(pre, input_embedding(model, index, pre), stack, post, head, tuple(left_out))


def _stack_glob(blocks: tuple[str, ...]) -> str:
    """A glob naming every child of the blocks' parent (``layers.*``)."""
    parent = blocks[0].rpartition(".")[0]
    return f"{parent}.*" if parent else "*"


def _inside(fqn: str, module: str) -> bool:
    return fqn == module or fqn.startswith(module + ".")


def _holds_params(index: ModelIndex, fqn: str) -> bool:
    """Whether the subtree of ``fqn`` holds any parameter (from the walk's slots)."""
    module = index.modules.get(fqn)
    if module is None:
        return False
    at = index.walk.position[id(module)]
    first, end = index.subtree_slots(at)
    return end > first


def output_head(model: nn.Module, index: ModelIndex) -> str | None:
    """The FQN of the output head (see :func:`output_head_module`)."""
    head = output_head_module(model, index.modules)
    return None if head is None else index.fqn_of_module.get(id(head))


def _declared_module(model: nn.Module, getter: str) -> nn.Module | None:
    """What a Hugging Face model's ``get_output_embeddings`` /
    ``get_input_embeddings`` returns; ``None`` where it has no such method or
    its method declines."""
    fn = getattr(model, getter, None)
    if not callable(fn):
        return None
    try:
        found = fn()
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, nn.Module) else None


def output_head_module(model: nn.Module, modules: Mapping[str, nn.Module]) -> nn.Module | None:
    """The output head: what a Hugging Face model's ``get_output_embeddings``
    returns, else a root ``lm_head`` or ``output`` Linear (torchtitan's name)."""
    found = _declared_module(model, "get_output_embeddings")
    if found is not None:
        return found
    return next((m for name in ("lm_head", "output") if isinstance(m := modules.get(name), nn.Linear)), None)


def input_embedding(model: nn.Module, index: ModelIndex, pre: tuple[str, ...]) -> str | None:
    """The module the sequence enters through: ``get_input_embeddings()``
    where the model has it, else the first ``nn.Embedding`` before the stack."""
    found = _declared_module(model, "get_input_embeddings")
    fqn = index.fqn_of_module.get(id(found)) if found is not None else None
    return fqn if fqn is not None else next((f for f in pre if isinstance(index.modules[f], nn.Embedding)), None)
