"""A model's pipeline parts, and the module of one pipeline stage.

Pipeline parallelism runs each stage's share of the model on its own ranks.
The *parts* of a model, in forward order, are the modules holding parameters
before the block stack (the embedding), each block, and the modules after it
(the final norm, the head), found by walking the *spine*: the root down to
the container holding the blocks. A stage holds a contiguous run of parts.

A stage's module is a new spine over the original parts: every spine module
is copied (its own child, parameter, buffer and hook tables), the parts the
stage holds are the original modules, and the parts it does not hold are
either left out of the block container or replaced by a :class:`StageGap`,
which passes the stream through. The model's own ``forward`` then runs the
stage: an embedding that is a gap hands the received activation on, a head
that is a gap returns the stage's output. Every kept module keeps its FQN
(blocks of an ``nn.ModuleList`` stay ``layers.3`` in :class:`StageBlocks`),
so checkpoints load across pipeline sizes. Building a stage changes nothing
in the model it reads: the copies are new objects.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._gap import StageGap
from ._index import STAGE_BLOCKS_ATTRIBUTE, STAGE_MODEL_ATTRIBUTE, ModelIndex, ModelNames, PlanningError

__all__ = ["STAGE_ATTRIBUTE", "PipelineParts", "StageBlocks", "StageGap", "build_stage_module", "pipeline_parts", "stage_of"]

# Set on a stage's root: (stage index, number of stages). The sequence-layout
# pass reads it to know the stream enters or leaves the stage sharded.
STAGE_ATTRIBUTE = "_fsdptx_pipeline_stage"


class StageBlocks(nn.Module):
    """One stage's blocks out of an ``nn.ModuleList``, registered under
    their original indices (``"3"``, ``"4"``), so their FQNs and checkpoint
    keys are those of the whole model. It iterates and slices like the list
    it came from (a slice is taken over the kept blocks: a forward that
    runs ``self.layers[: n_layers]`` runs this stage's blocks); an integer
    index is the original one."""

    def __init__(self, blocks: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, block in blocks.items():
            self.add_module(name, block)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return list(self)[key]
        found = self._modules.get(str(key))
        if found is None:
            raise IndexError(f"block {key} is not on this pipeline stage (its blocks: {', '.join(self._modules)})")
        return found


@dataclass(frozen=True)
class PipelineParts:
    """A model's parts in forward order.

    Attributes:
        before: modules with parameters before the blocks (the embedding).
        blocks: the blocks, in the order their container runs them (its
            registration order: an ``nn.ModuleList``'s index order).
        after: modules with parameters after the blocks (norm, head).
        container: the FQN of the module holding the blocks.
        spine: the root down to ``container``, as FQNs.
    """

    before: tuple[str, ...]
    blocks: tuple[str, ...]
    after: tuple[str, ...]
    container: str
    spine: tuple[str, ...]

    @property
    def ordered(self) -> tuple[str, ...]:
        """Every part, in forward order."""
        return self.before + self.blocks + self.after

    @classmethod
    def from_split(cls, ordered: tuple[str, ...], container: str) -> PipelineParts:
        """The parts again from a Plan's stages (``ordered``: their parts
        one after another) and the blocks' container: what applying a
        pipelined Plan rebuilds the stage modules from."""
        inside = [i for i, f in enumerate(ordered) if _parent(f) == container]
        first, last = (inside[0], inside[-1]) if inside else (len(ordered), len(ordered) - 1)
        spine = [""]
        if container:
            segments = container.split(".")
            spine += [".".join(segments[: i + 1]) for i in range(len(segments))]
        return cls(ordered[:first], ordered[first : last + 1], ordered[last + 1 :], container, tuple(spine))


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _holds_tensors(index: ModelIndex, fqn: str) -> bool:
    lo, hi = index.subtree_slots(index.module_fqns.index(fqn))
    return hi > lo


def pipeline_parts(model: nn.Module, index: ModelIndex, blocks: tuple[str, ...]) -> PipelineParts:
    """The parts of ``model`` around ``blocks`` (FQNs, e.g. from
    :func:`~fsdptx.model._index.discover_blocks`), in forward order: the
    blocks are taken in the order their container registers (and runs)
    them, whatever order they are given in (``blocks=["MoEBlock",
    "DenseBlock"]`` lists the MoE blocks first; the stages must not).

    The blocks must be children of one container; every spine module's other
    children holding parameters become parts, before or after the stack by
    registration order (Hugging Face: ``model.embed_tokens`` before,
    ``model.norm`` and ``lm_head`` after). Children without parameters
    (rotary tables) are kept on every stage.

    Raises:
        PlanningError: no blocks; blocks under several containers;
            parameters held directly by a spine module (every stage would
            hold them, so they would be trained once per stage).
    """
    name = type(model).__name__
    if not blocks:
        raise PlanningError(
            f"pipeline parallelism: found no blocks in {name} to split into stages; name them with "
            "FSDP2Config(blocks=...) or declare _no_split_modules"
        )
    containers = sorted({_parent(b) for b in blocks})
    if len(containers) != 1:
        raise PlanningError(
            f"pipeline parallelism: the blocks of {name} sit in several containers {containers}; stages split "
            "one stack of blocks: name the blocks of one stack with FSDP2Config(blocks=...), or give the "
            "stages explicitly (PipelineParallelConfig(stages=...))"
        )
    container = containers[0]
    position = {_join(container, n): i for i, n in enumerate(index.modules[container]._modules)}
    blocks = tuple(sorted(blocks, key=position.__getitem__))
    spine = list(PipelineParts.from_split((), container).spine)
    direct = [f for f in spine if index.direct_param_fqns(f)]
    if direct:
        held = [p for f in direct for p in index.direct_param_fqns(f)]
        raise PlanningError(
            f"pipeline parallelism: parameters {held} are held directly by {direct}, which contain the blocks; "
            "every stage would hold and train them: move them into a submodule"
        )
    block_set = set(blocks)
    before: list[str] = []
    after: list[str] = []
    for depth, fqn in enumerate(spine[:-1]):
        below = spine[depth + 1]
        seen_below = False
        for child in index.modules[fqn]._modules:
            child_fqn = _join(fqn, child)
            if child_fqn == below:
                seen_below = True
            elif child_fqn in index.modules and _holds_tensors(index, child_fqn):
                # Outer parts wrap inner ones: before-parts go in order of depth,
                # after-parts in reverse (inner first).
                (after if seen_below else before).append(child_fqn)
    others = [
        _join(container, c)
        for c in index.modules[container]._modules
        if _join(container, c) not in block_set and _join(container, c) in index.modules
        and _holds_tensors(index, _join(container, c))
    ]
    if others:
        raise PlanningError(
            f"pipeline parallelism: {container or '<root>'} holds {others} beside its blocks; stages split a "
            "container of blocks only: name every block with FSDP2Config(blocks=...)"
        )
    depth_of = {f: f.count(".") for f in after}
    after.sort(key=lambda f: -depth_of[f])  # stable: inner spine level first
    return PipelineParts(tuple(before), tuple(blocks), tuple(after), container, tuple(spine))


def stage_of(fqn: str, stages: tuple[tuple[str, ...], ...]) -> int | None:
    """The stage whose parts contain ``fqn`` (a module or parameter FQN)."""
    for i, parts in enumerate(stages):
        if any(fqn == p or fqn.startswith(p + ".") for p in parts):
            return i
    return None


def _copy_spine_module(module: nn.Module) -> nn.Module:
    """A new module object sharing ``module``'s tensors and submodules but
    with tables of its own (children, parameters, buffers, hooks), so
    changing the copy's children or hooks leaves ``module`` as it was. Each
    table keeps its type: torch's hook registration relies on it."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict):
            clone.__dict__[key] = copy.copy(value)
    return clone


def _stage_output(out: Any) -> Any:
    """The tensor a stage hands on: Hugging Face models return an output
    record (its ``logits``, or ``last_hidden_state`` for a base model) or a
    tuple (its first element)."""
    if isinstance(out, torch.Tensor):
        return out
    for attr in ("logits", "last_hidden_state"):
        found = getattr(out, attr, None)
        if isinstance(found, torch.Tensor):
            return found
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


def _stage_forward(forward: Callable[..., Any], takes_use_cache: bool, *args: Any, **kwargs: Any) -> Any:
    """The model's own forward, with no KV cache (a stage is trained, not
    decoded), returning the one tensor pipeline stages exchange."""
    if takes_use_cache:
        kwargs.setdefault("use_cache", False)
    return _stage_output(forward(*args, **kwargs))


def build_stage_module(
    model: nn.Module, index: ModelIndex, parts: PipelineParts, held: tuple[str, ...], stage: int, num_stages: int
) -> nn.Module:
    """The module of the stage holding ``held`` (parts of ``parts``).

    Pure: ``model`` is read, never changed. The result's spine modules are
    copies; the parts it holds are ``model``'s own modules (so applying a
    plan to the stage shards them in place); parts it does not hold are left
    out of the block container or replaced by :class:`StageGap`. Its
    ``forward`` is the model's, returning one tensor. It declares the blocks
    it holds, so planning the stage finds the blocks the whole model has.
    """
    keep = set(held)
    spine = set(parts.spine)
    copies: dict[str, nn.Module] = {}
    for fqn in parts.spine:
        original = index.modules[fqn]
        if fqn == parts.container and isinstance(original, nn.ModuleList):
            kept = {n: c for n, c in original._modules.items() if c is not None and _join(fqn, n) in keep}
            copies[fqn] = StageBlocks(kept)
            continue
        clone = _copy_spine_module(original)
        children = clone._modules
        for name in list(children):
            child = _join(fqn, name)
            if child in spine:
                continue
            if fqn == parts.container:
                if child not in keep:
                    del children[name]
            elif child in parts.before or child in parts.after:
                if child not in keep:
                    children[name] = StageGap(child)
        copies[fqn] = clone
    for fqn in parts.spine[1:]:
        copies[_parent(fqn)]._modules[fqn.rpartition(".")[2]] = copies[fqn]
    root = copies[""]
    forward = type(model).forward.__get__(root)
    takes_use_cache = "use_cache" in inspect.signature(forward).parameters
    root.forward = functools.partial(_stage_forward, forward, takes_use_cache)
    setattr(root, STAGE_ATTRIBUTE, (stage, num_stages))
    setattr(root, STAGE_BLOCKS_ATTRIBUTE, tuple(fqn for fqn in parts.blocks if fqn in keep))
    setattr(root, STAGE_MODEL_ATTRIBUTE, ModelNames.of(index))
    return root
