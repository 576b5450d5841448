"""The model index: FQN <-> object tables built from one walk, and the
model's blocks (discovered from its declarations or named by a spec).

Planning, TP and applying all read one :class:`ModelIndex` per call."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..core._caches import memo_property
from ..core._globs import WRAPPER_SEGMENTS, innermost, match_logical, unwrap
from ..core._names import name_tokens, natural_key
from ..core._tree import get_module_from_path, join_fqn
from ._unit_checks import is_container
from ._gap import StageGap
from ._walk import TIE_ATTRIBUTES, ModelWalk, declared_ties, walk_model

__all__ = ["STAGE_BLOCKS_ATTRIBUTE", "STAGE_MODEL_ATTRIBUTE", "ModelIndex", "ModelNames", "PlanningError", "discover_blocks", "empty_containers_note", "kv_cache_configs", "kv_cache_switches", "resolve_blocks"]

_NUMEL = operator.methodcaller("numel")


class PlanningError(ValueError):
    """A request cannot be planned for this model; raised before any mutation.

    A ``ValueError``, so callers that catch bad arguments catch it too; the
    message names the modules or globs concerned and says what to change.

    Example::

        try:
            fsdptx.plan(model, functools.partial(fsdptx.shard_by_dtype, blocks=["layer.*"]))
        except fsdptx.PlanningError as e:
            print(e)  # names the glob that matched nothing
    """


def kv_cache_configs(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, object]]:
    """Where a model's KV cache is on: ``(path, config)`` for each distinct
    config object its modules hold with ``use_cache`` true, the path as
    ``model.<fqn>.config.use_cache`` (a multimodal model's language model
    reads its text config, not the top-level one). Reads only."""
    found: list[tuple[str, object]] = []
    seen: set[int] = set()
    for fqn, module in modules:
        config = module.__dict__.get("config")
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            found.append((f"model.{fqn}.config.use_cache" if fqn else "model.config.use_cache", config))
    return found


def kv_cache_switches(modules: Iterable[tuple[str, nn.Module]]) -> tuple[str, ...]:
    """The paths of :func:`kv_cache_configs`: what activation checkpointing
    turns off when applied, and what the Plan records it will."""
    return tuple(path for path, _config in kv_cache_configs(modules))


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """Look through activation-checkpoint and ``torch.compile`` wrappers."""
    return unwrap(module)


@dataclass
class ModelIndex:
    """FQN <-> object tables for one model, built from one :func:`walk_model`.

    A tied parameter's canonical FQN is the name its model declares as the
    tie's source (Hugging Face ``_tied_weights_keys``: ``{target: source}``,
    or a list of target names), else its smallest name (plain string order).
    Both are rank-stable: neither depends on registration order. ``aliases``
    keeps its other names, because a pinned-fp32 token may appear in any.
    ``walk`` is kept: its signature is what a Plan vouches for.
    """

    root: nn.Module
    walk: ModelWalk
    modules: dict[str, nn.Module] = field(default_factory=dict)
    param_fqn: dict[int, str] = field(default_factory=dict)
    param_objects: list[nn.Parameter] = field(default_factory=list)
    first_slots: list[int] = field(default_factory=list)  # per param object: its first slot in the walk
    aliases: dict[int, list[str]] = field(default_factory=dict)
    sharded: set[int] = field(default_factory=set)
    # Read by the survey instead of the modules' own dicts, which a large
    # model no longer holds in the CPU caches once walked: per walk position,
    # the end of its subtree in pre-order (exclusive; exact on a tree) and
    # its first parameter slot (one more entry closes the last module's
    # slots); per slot, its parameter's canonical FQN.
    # Per walk position, the module's FQN and class (the class as the walk's
    # signature recorded it): the class is read without touching the module.
    module_fqns: list[str] = field(default_factory=list)
    module_types: list[type] = field(default_factory=list)
    subtree_end: list[int] = field(default_factory=list)
    slot_start: list[int] = field(default_factory=list)
    slot_fqn: list[str] = field(default_factory=list)

    @property
    def shared_modules(self) -> bool:
        """Whether some module is registered under two parents."""
        return self.walk.shared_modules

    @classmethod
    def build(cls, root: nn.Module, *, enter_sharded: bool = True) -> ModelIndex:
        """Index ``root``; ``enter_sharded=False`` leaves out what FSDP
        modules below it hold (see :func:`walk_model`)."""
        return cls.from_walk(root, walk_model(root, enter_sharded=enter_sharded))

    @classmethod
    def from_walk(cls, root: nn.Module, walk: ModelWalk) -> ModelIndex:
        """Index ``root`` from its walk, taken a moment ago."""
        index = cls(root, walk)
        modules, parents, names = walk.modules, walk.parents, walk.names
        fqns = [""] * len(modules)
        for i in range(1, len(modules)):
            up = fqns[parents[i]]
            fqns[i] = f"{up}.{names[i]}" if up else names[i]
        index.modules = dict(zip(fqns, modules))
        index.module_fqns = fqns
        types = index.module_types = walk.types
        fsdp = {t for t in set(types) if issubclass(t, FSDPModule)}
        if fsdp:
            index.sharded = {id(m) for m, t in zip(modules, types) if t in fsdp}
        param_fqn, objects, first, aliases = index.param_fqn, index.param_objects, index.first_slots, index.aliases
        slot_fqn = index.slot_fqn
        start = [0] * (len(modules) + 1)
        for slot, (owner, name, p) in enumerate(zip(walk.owners, walk.slot_names, walk.params)):
            start[owner + 1] += 1
            up = fqns[owner]
            fqn = f"{up}.{name}" if up else name
            slot_fqn.append(fqn)
            pid = id(p)
            known = param_fqn.get(pid)
            if known is None:
                param_fqn[pid] = fqn
                objects.append(p)
                first.append(slot)
            else:
                # Canonical is the smallest name, as in rank-stable order:
                # registration order may differ between ranks.
                smaller, other = sorted((known, fqn))
                param_fqn[pid] = smaller
                aliases.setdefault(pid, []).append(other)
        if aliases:
            index._prefer_declared_tie_sources()
            index.slot_fqn = [param_fqn[id(p)] for p in walk.params]  # every slot under its canonical name
        for i in range(len(modules)):
            start[i + 1] += start[i]
        end = list(range(1, len(modules) + 1))
        for i in range(len(modules) - 1, 0, -1):  # children follow their parent in pre-order
            above = parents[i]
            if end[above] < end[i]:
                end[above] = end[i]
        index.subtree_end = end
        index.slot_start = start
        return index

    def _prefer_declared_tie_sources(self) -> None:
        """Rename tied parameters after the source their model declares.

        A reader of a plan looks for ``model.embed_tokens.weight`` (what the
        checkpoint stores and the model calls the source), not whichever alias
        sorts first (``lm_head.weight``). Only exact parameter names count;
        pattern-style declarations name no parameter and fall back to the
        smallest name.
        """
        sources: dict[str, str] = {}  # target FQN -> source FQN
        targets: set[str] = set()
        for fqn, module in self.modules.items():
            prefix = fqn + "." if fqn else ""
            for attr in TIE_ATTRIBUTES:
                declared = declared_ties(module, attr)
                if isinstance(declared, dict):
                    sources.update(
                        (prefix + t, prefix + s) for t, s in declared.items() if isinstance(t, str) and isinstance(s, str)
                    )
                elif isinstance(declared, (list, tuple, set, frozenset)):
                    targets.update(prefix + t for t in declared if isinstance(t, str))
        if not sources and not targets:
            return
        for pid, others in self.aliases.items():
            names = sorted((self.param_fqn[pid], *others))
            named = set(names)
            declared_sources = sorted(sources[n] for n in names if sources.get(n) in named)
            untargeted = [n for n in names if n not in targets] if named & targets else []
            preferred = (declared_sources or untargeted or names)[0]
            self.param_fqn[pid] = preferred
            self.aliases[pid] = [n for n in names if n != preferred]

    @property
    def param_facts(self) -> dict[int, tuple[torch.dtype, int, int, object, bool]]:
        """Per parameter id: (storage dtype, numel, bytes, ``_hf_compute_dtype``
        hint, requires_grad), read once for all of planning; dtype and
        ``requires_grad`` as the walk's signature recorded them."""
        return self._param_tables[0]

    @property
    def numel_by_kind(self) -> dict[tuple[torch.dtype, bool], int]:
        """Total numel of the parameters per (storage dtype, requires_grad)."""
        return self._param_tables[1]

    @memo_property
    def _param_tables(
        self,
    ) -> tuple[dict[int, tuple[torch.dtype, int, int, object, bool]], dict[tuple[torch.dtype, bool], int]]:
        """:attr:`param_facts` and :attr:`numel_by_kind`, from one pass over
        the parameters."""
        facts = {}
        totals: dict[tuple[torch.dtype, bool], int] = {}
        read, numels = self.walk.facts, self.slot_numels
        for p, slot in zip(self.param_objects, self.first_slots):
            dtype, grad, _ndim = read[slot]
            n = numels[slot]
            facts[id(p)] = (dtype, n, n * dtype.itemsize, getattr(p, "_hf_compute_dtype", None), grad)
            kind = (dtype, grad)
            totals[kind] = totals.get(kind, 0) + n
        return facts, totals

    @memo_property
    def slot_numels(self) -> list[int]:
        """Per parameter slot, its parameter's numel."""
        return list(map(_NUMEL, self.walk.params))

    @memo_property
    def up_distance(self) -> list[int]:
        """Per walk position, how far back its parent is (0 for the root):
        the tree's shape in a form equal for two subtrees built alike, so
        comparing them is a comparison of slices."""
        return list(map(operator.sub, range(len(self.walk.parents)), self.walk.parents))

    @memo_property
    def direct_counts(self) -> list[int]:
        """Per walk position, how many parameter slots the module has."""
        start = self.slot_start
        return list(map(operator.sub, start[1:], start[:-1]))

    def fqn_of(self, module: nn.Module) -> str:
        """The FQN of a module of the model (``KeyError`` for any other)."""
        return self.module_fqns[self.walk.position[id(module)]]

    @memo_property
    def fqn_of_module(self) -> dict[int, str]:
        """Module id -> FQN, for lookups that may miss (built on first use)."""
        return {id(m): f for m, f in zip(self.walk.modules, self.module_fqns)}

    def subtree_slots(self, at: int) -> tuple[int, int]:
        """The parameter slots of the subtree at walk position ``at``, as
        ``(first, end)``: a subtree's slots are contiguous in pre-order."""
        return self.slot_start[at], self.slot_start[self.subtree_end[at]]

    def direct_param_fqns(self, fqn: str) -> list[str]:
        """Canonical FQNs of the direct parameters of module ``fqn``, from
        the walk's slots: reading the module's ``_parameters`` again would
        touch memory a large model has long evicted from the CPU caches."""
        at = self.walk.position[id(self.modules[fqn])]
        return self.slot_fqn[self.slot_start[at] : self.slot_start[at + 1]]

    def has_param(self, fqn: str) -> bool:
        """Whether ``fqn`` is the canonical name of a parameter (a key of
        :attr:`params`), answered from the slots of its module alone."""
        module_fqn = fqn.rpartition(".")[0]
        return module_fqn in self.modules and fqn in self.direct_param_fqns(module_fqn)

    @property
    def tied(self) -> bool:
        """Whether some parameter has two names."""
        return bool(self.aliases)

    @memo_property
    def params(self) -> dict[str, nn.Parameter]:
        """Canonical FQN -> parameter (built on first use), from the slot lists
        rather than ``param_fqn``: sequential reads, no hashing of ids."""
        slot_fqn = self.slot_fqn
        return dict(zip([slot_fqn[s] for s in self.first_slots], self.param_objects))

    def param_named(self, fqn: str) -> nn.Parameter | None:
        """The parameter called ``fqn`` under its canonical name or an alias."""
        found = self.params.get(fqn)
        if found is None and self.aliases:
            found = next(
                (p for p in self.param_objects if fqn in self.aliases.get(id(p), ())), None
            )
        return found

    def names(self, p: nn.Parameter) -> list[str]:
        """Every FQN of ``p``, canonical first."""
        return [self.param_fqn[id(p)], *self.aliases.get(id(p), ())]

    @memo_property
    def by_logical(self) -> dict[str, str]:
        """Logical FQN (wrapper segments removed) -> the innermost module's
        real FQN, in walk order (see :mod:`fsdptx.core._globs`)."""
        return innermost(self.module_fqns)

    def match(self, pattern: str) -> list[str]:
        """Real FQNs of the modules a one-segment-per-``*`` glob matches,
        wrappers seen through; the root never matches, nor does a pipeline
        stage's :class:`~fsdptx.model._gap.StageGap` (it stands for a part
        another stage holds)."""
        found = match_logical(pattern, self.by_logical)
        gaps = self.stage_gaps
        return [f for f in found if f not in gaps] if gaps else found

    @memo_property
    def stage_gaps(self) -> frozenset[str]:
        """FQNs of the stage gaps in the model (none outside pipeline stages)."""
        if StageGap not in self.module_types:
            return frozenset()
        return frozenset(f for f, t in zip(self.module_fqns, self.module_types) if t is StageGap)

    @memo_property
    def blocks(self) -> tuple[str, ...]:
        """The blocks :func:`discover_blocks` finds, computed once per index."""
        return discover_blocks(self.root, self)

    def module(self, fqn: str, what: str) -> nn.Module:
        found = self.modules.get(fqn)
        if found is None:
            try:
                get_module_from_path(self.root, fqn)
            except AttributeError as e:
                raise PlanningError(f"{what}: {e}") from None
            raise PlanningError(f"{what}: module {fqn!r} is not reachable from the model root")
        return found


def empty_containers_note(index: ModelIndex) -> str:
    """Why a model may have no blocks, for the messages that say none were
    found: its ``nn.ModuleList``/``nn.ModuleDict`` containers that hold no
    module (a zero-layer model). ``""`` when there is none."""
    empty = [
        f or "<root>"
        for f, cls, m in zip(index.module_fqns, index.module_types, index.walk.modules)
        if issubclass(cls, (nn.ModuleList, nn.ModuleDict)) and is_container(m) and not m._modules
    ]
    if not empty:
        return ""
    shown = ", ".join(repr(f) for f in empty[:3]) + (f" and {len(empty) - 3} more" if len(empty) > 3 else "")
    return f" ({shown} {'holds' if len(empty) == 1 else 'hold'} no modules: the model has zero layers)"


# A pipeline stage's module declares the whole model's blocks that it holds
# (a stage may hold one block, which no container rule could tell).
STAGE_BLOCKS_ATTRIBUTE = "_fsdptx_stage_blocks"
# It also carries the whole model's module names (a :class:`ModelNames`), so
# a ``blocks=`` entry naming only modules other stages hold is told apart
# from one naming no module at all.
STAGE_MODEL_ATTRIBUTE = "_fsdptx_stage_model"


@dataclass(frozen=True)
class ModelNames:
    """The names a whole model answers to: its class, its modules' FQNs and
    their class names. Strings only, so a pipeline stage's module can carry
    them without keeping the other stages' modules alive.

    Attributes:
        model: the model's class name.
        fqns: every module FQN, in walk order.
        classes: the class names of its modules.
    """

    model: str
    fqns: tuple[str, ...]
    classes: frozenset[str]

    @classmethod
    def of(cls, index: ModelIndex) -> ModelNames:
        return cls(type(index.root).__name__, tuple(index.module_fqns), frozenset(t.__name__ for t in set(index.module_types)))

    def matches(self, entry: str) -> bool:
        """Whether a ``blocks=`` entry (a module FQN, a class name or a glob,
        see :func:`resolve_blocks`) names any module of the model."""
        if entry in self.classes or entry in self.fqns:
            return True
        return bool(match_logical(entry, innermost(self.fqns)))


def discover_blocks(model: nn.Module, index: ModelIndex | None = None) -> tuple[str, ...]:
    """The model's repeated blocks, by the conventions models already declare.

    A pipeline stage's module answers with the blocks it was built to hold
    (:data:`STAGE_BLOCKS_ATTRIBUTE`): the blocks found in the whole model,
    so a stage holding a single block still plans it as a block.

    ``_no_split_modules`` class names (Hugging Face's marker for "keep this
    module whole") win; a block wrapped for activation checkpointing or by
    ``torch.compile`` is taken with its wrapper. Otherwise the children of
    the ``nn.ModuleList`` or ``nn.ModuleDict`` holding the most children of
    one class (torchtitan keeps its blocks in a ``ModuleDict``), when that
    is at least two. Matches nested inside another match are not blocks of
    their own. Blocks come in index order (``layers.2`` before
    ``layers.10``), not registration order, so every rank lists them alike.
    An empty result means none was found: callers say so.
    """
    idx = index or ModelIndex.build(model)
    declared = getattr(model, STAGE_BLOCKS_ATTRIBUTE, None)
    if declared is not None:
        return tuple(declared)
    class_names = set(name_tokens(getattr(model, "_no_split_modules", None), "_no_split_modules", type(model).__name__))
    if class_names:
        found = _blocks_of_classes(idx, class_names)
        if found:
            return found
    best: tuple[int, str, nn.Module] | None = None
    for fqn, cls, module in zip(idx.module_fqns, idx.module_types, idx.walk.modules):
        if not issubclass(cls, (nn.ModuleList, nn.ModuleDict)) or not is_container(module):
            continue  # a list class with a forward of its own is a module, not a stack
        classes = Counter(type(unwrap(c)) for c in module._modules.values() if c is not None)
        score = max(classes.values(), default=0)
        if score >= 2 and (best is None or score > best[0]):
            best = (score, fqn, module)
    if best is None:
        return ()
    return tuple(join_fqn(best[1], n) for n, c in best[2]._modules.items() if c is not None)


def _outermost(fqn: str) -> str:
    """The FQN of the outermost wrapper around ``fqn``'s module."""
    while fqn.rpartition(".")[2] in WRAPPER_SEGMENTS:
        fqn = fqn.rpartition(".")[0]
    return fqn


def _blocks_of_classes(idx: ModelIndex, class_names: Collection[str]) -> tuple[str, ...]:
    """Modules whose class is one of ``class_names`` (wrappers seen
    through), outermost first, in index order. The classes are picked
    once; the modules of theirs are then found at C level."""
    wanted = {t for t in set(idx.module_types) if t.__name__ in class_names}
    found: list[str] = []
    for fqn in compress(idx.module_fqns, map(wanted.__contains__, idx.module_types)):
        if not fqn:
            continue
        fqn = _outermost(fqn)
        if fqn and not any(fqn == f or fqn.startswith(f + ".") for f in found[-1:]):
            found.append(fqn)
    return tuple(sorted(found, key=natural_key))


def resolve_blocks(spec: Sequence[str], index: ModelIndex, where: str) -> tuple[str, ...]:
    """Blocks named by ``spec``: each entry an exact module FQN, a class
    name (``"LlamaDecoderLayer"``), or a glob with one segment per ``*``
    (``"layers.*"``), wrappers seen through. A container matched (an
    ``nn.ModuleList`` or ``nn.ModuleDict`` without a forward of its own,
    ``"layers"``) means its children: it never runs, so checkpointing it,
    or ending the block order and the prefetch chains at it, would do
    nothing. An entry matching nothing (or only empty containers) is an
    error naming it; the result keeps the entries' order, each entry's
    matches in index order.

    On a pipeline stage's module, an entry is written for the whole model:
    one naming only modules other stages hold (a dense-first model's
    dense block class, on a stage of MoE blocks) matches nothing here and
    is passed over; one naming no module of the whole model is still an
    error."""
    out: list[str] = []
    classes = {t.__name__ for t in set(index.module_types)}
    whole = getattr(index.root, STAGE_MODEL_ATTRIBUTE, None)
    for entry in spec:
        if entry in index.modules:
            matched: tuple[str, ...] = (entry,)
        elif "." not in entry and "*" not in entry and entry in classes:
            matched = _blocks_of_classes(index, (entry,))
        else:
            matched = tuple(sorted({_outermost(f) for f in index.match(entry)}, key=natural_key))
        matched = tuple(b for m in matched for b in _contained(index, m))
        if not matched:
            if isinstance(whole, ModelNames):
                if whole.matches(entry):
                    continue  # it names modules other pipeline stages hold
                raise PlanningError(
                    f"{where}: blocks entry {entry!r} matches no module of {whole.model}, on this pipeline stage "
                    "or any other (give module FQNs, a block class name, or globs such as 'layers.*')"
                )
            raise PlanningError(
                f"{where}: blocks entry {entry!r} matches no module of {type(index.root).__name__} "
                "(give module FQNs, a block class name, or globs such as 'layers.*')"
            )
        out.extend(m for m in matched if m not in out)
    return tuple(out)


def _contained(index: ModelIndex, fqn: str) -> list[str]:
    """``fqn``, or, for a container, the blocks it holds (its children in
    index order, containers among them expanded in turn)."""
    module = index.modules[fqn]
    if not is_container(module):
        return [fqn]
    children = sorted((join_fqn(fqn, n) for n, c in module._modules.items() if c is not None), key=natural_key)
    return [b for c in children for b in _contained(index, c)]
