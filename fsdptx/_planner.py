"""Pure planning: turn a model and a request into FSDP units.

One model index is built per call; dtype units and cross-block units are then
resolved in application order while tracking which modules are already
"sharded" in the plan, exactly as ``fully_shard`` would see them. Each module
is visited a bounded number of times, so planning is linear in model size.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from ._dtypes import is_pinned, resolve_compute_dtype
from ._plan import CrossBlockRequest, DtypeRequest, Unit, UnitKind
from ._policy import get_internal_fsdp_mp_policy, mp_policy_with_param_dtype
from ._tree import get_module_from_path, join_fqn, maximal_uniform_subtrees

__all__ = ["ModelIndex", "PlanningError", "discover_blocks", "resolve_units"]

DtypeKey = tuple[torch.dtype, torch.dtype]  # (storage, compute)


class PlanningError(ValueError):
    """A request cannot be planned for this model; raised before any mutation."""


def is_container(module: nn.Module) -> bool:
    """``fully_shard`` rejects ModuleList/ModuleDict that do not define forward."""
    return (
        isinstance(module, (nn.ModuleList, nn.ModuleDict))
        and type(module).forward is nn.Module.forward
    )


def unwrap_checkpoint(module: nn.Module) -> nn.Module:
    """Look through activation-checkpoint wrappers (``_checkpoint_wrapped_module``)."""
    inner = module._modules.get("_checkpoint_wrapped_module")
    while inner is not None:
        module = inner
        inner = module._modules.get("_checkpoint_wrapped_module")
    return module


@dataclass
class ModelIndex:
    """FQN <-> object tables for one model, built in one walk.

    A tied parameter's canonical FQN is its smallest name (plain string order),
    so every rank names it alike whatever the registration order; ``aliases``
    keeps its other names, because a pinned-fp32 token may appear in any.
    """

    root: nn.Module
    modules: dict[str, nn.Module] = field(default_factory=dict)
    fqn_of_module: dict[int, str] = field(default_factory=dict)
    param_fqn: dict[int, str] = field(default_factory=dict)
    param_objects: list[nn.Parameter] = field(default_factory=list)
    aliases: dict[int, list[str]] = field(default_factory=dict)
    sharded: set[int] = field(default_factory=set)
    shared_modules: bool = False  # some module is registered under two parents

    @classmethod
    def build(cls, root: nn.Module) -> ModelIndex:
        index = cls(root)
        modules, fqn_of_module, param_fqn, objects = (
            index.modules, index.fqn_of_module, index.param_fqn, index.param_objects
        )
        stack: list[tuple[str, nn.Module]] = [("", root)]
        while stack:
            fqn, module = stack.pop()
            mid = id(module)
            if mid in fqn_of_module:
                index.shared_modules = True  # first path wins, as named_modules
                continue
            modules[fqn] = module
            fqn_of_module[mid] = fqn
            if isinstance(module, FSDPModule):
                index.sharded.add(mid)
            prefix = fqn + "." if fqn else ""
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) in param_fqn:
                    # Canonical is the smallest name, as in rank-stable order:
                    # registration order may differ between ranks.
                    first, other = sorted((param_fqn[id(p)], prefix + name))
                    param_fqn[id(p)] = first
                    index.aliases.setdefault(id(p), []).append(other)
                else:
                    param_fqn[id(p)] = prefix + name
                    objects.append(p)
            children = module._modules
            if children:
                stack.extend((prefix + n, c) for n, c in reversed(children.items()) if c is not None)
        return index

    @functools.cached_property
    def param_facts(self) -> dict[int, tuple[torch.dtype, int, int, object]]:
        """Per parameter id: (storage dtype, numel, bytes, ``_hf_compute_dtype``
        hint), read from each tensor once for all of planning."""
        facts = {}
        for p in self.param_objects:
            n = p.numel()
            facts[id(p)] = (p.dtype, n, n * p.element_size(), getattr(p, "_hf_compute_dtype", None))
        return facts

    @property
    def tied(self) -> bool:
        """Whether some parameter has two names."""
        return bool(self.aliases)

    @functools.cached_property
    def params(self) -> dict[str, nn.Parameter]:
        """Canonical FQN -> parameter (built on first use: most plans never need it)."""
        return {self.param_fqn[id(p)]: p for p in self.param_objects}

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

    @functools.cached_property
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


def claim(
    index: ModelIndex, roots: Sequence[nn.Module], stop: set[int]
) -> list[tuple[str, nn.Parameter]]:
    """The parameters ``fully_shard(roots)`` would manage, before ignoring any:
    direct parameters of every module reachable from ``roots`` without entering
    a module already sharded (``stop``). Each tied parameter once."""
    if len(roots) == 1:
        return _survey(index, roots[0], stop)[2]
    return _first_occurrences([item for r in roots for item in _survey(index, r, stop)[2]])


def _first_occurrences(claimed: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """Keep each parameter once: FSDP manages a parameter reached twice once."""
    seen: set[int] = set()
    out = []
    for f, p in claimed:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((f, p))
    return out


@dataclass
class _Resolver:
    """Mutable scratch state for one resolution; never escapes ``resolve_units``."""

    index: ModelIndex
    mp_policy: MixedPrecisionPolicy | None
    offload_policy: OffloadPolicy | None
    excluded: set[int]  # params owned elsewhere or ignored: never grouped, never claimed
    sharded: set[int]  # modules that are, or will be by then, FSDP modules
    units: list[Unit] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)  # param id -> unit index
    policies: dict[tuple[torch.dtype | None, bool], MixedPrecisionPolicy | None] = field(default_factory=dict)

    def add(
        self,
        modules: Sequence[nn.Module],
        kind: UnitKind,
        policy: MixedPrecisionPolicy | None,
        reshard: bool | int | None,
        keys: dict[int, DtypeKey],
        claimed: list[tuple[str, nn.Parameter]] | None = None,
    ) -> Unit:
        """Record a unit owning what ``fully_shard(modules)`` would claim now
        (``claimed``, when the caller has just computed it)."""
        if claimed is None:
            claimed = claim(self.index, modules, self.sharded)
        here = [self.index.fqn_of_module[id(m)] for m in modules]
        excluded, owner, position = self.excluded, self.owner, len(self.units)
        facts = self.index.param_facts
        params: list[str] = []
        ignored: list[str] = []
        unit_keys: set[DtypeKey] = set()
        numel = nbytes = 0
        for f, p in claimed:  # one pass: this runs for every unit of the plan
            pid = id(p)
            if pid in excluded:
                earlier = owner.get(pid)
                if earlier is not None:
                    raise PlanningError(
                        f"parameter {f!r} is shared (also named {self.index.names(p)[1:]}) and would "
                        f"belong to two FSDP units: {list(self.units[earlier].modules)[:3]} and {here[:3]}. "
                        "FSDP2 needs a shared parameter inside one unit: shard a common ancestor as "
                        "one unit (e.g. leave it to the root), or untie the parameter"
                    )
                ignored.append(f)
                continue
            params.append(f)
            unit_keys.add(keys[pid])
            _dtype, n, b, _hint = facts[pid]
            numel += n
            nbytes += b
            excluded.add(pid)
            owner[pid] = position
        params.sort()  # FQN order: a unit is a set, and its listing must not
        ignored.sort()  # depend on the order a rank registered modules in
        storage = {k[0] for k in unit_keys}
        compute = {k[1] for k in unit_keys}
        unit = Unit(
            modules=tuple(here),
            params=tuple(params),
            ignored_params=tuple(ignored),
            kind=kind,
            storage_dtype=storage.pop() if len(storage) == 1 else None,
            compute_dtype=compute.pop() if len(compute) == 1 else None,
            mp_policy=policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=reshard,
            numel=numel,
            nbytes=nbytes,
        )
        self.units.append(unit)
        self.sharded.update(id(m) for m in modules)
        return unit

    def policy(self, compute: torch.dtype | None, internal: bool) -> MixedPrecisionPolicy | None:
        """The policy for a unit computing in ``compute`` (``None``: the
        caller's policy as is); internal units drop ``output_dtype``. Cached:
        thousands of units share a handful of policies."""
        key = (compute, internal)
        if key not in self.policies:
            policy = self.mp_policy if compute is None else mp_policy_with_param_dtype(self.mp_policy, compute)
            self.policies[key] = get_internal_fsdp_mp_policy(policy) if internal else policy
        return self.policies[key]


def param_keys(
    index: ModelIndex, mp_policy: MixedPrecisionPolicy | None, fp32_tokens: Collection[str]
) -> dict[int, DtypeKey]:
    """(storage, compute) dtype of every parameter, resolved once from the
    facts the index recorded (no tensor is consulted again); parameters with
    equal facts share one resolution."""
    tokens = tuple(fp32_tokens)
    cache: dict[tuple[torch.dtype, bool, object], DtypeKey] = {}
    keys: dict[int, DtypeKey] = {}
    aliases, param_fqn = index.aliases, index.param_fqn
    for pid, (dtype, _n, _b, hint) in index.param_facts.items():
        pinned = bool(tokens) and is_pinned(
            [param_fqn[pid], *aliases[pid]] if pid in aliases else (param_fqn[pid],), tokens
        )
        fact = (dtype, pinned, hint)
        key = cache.get(fact)
        if key is None:
            key = cache[fact] = (dtype, resolve_compute_dtype(dtype, pinned, hint, mp_policy))
        keys[pid] = key
    return keys


def _shardable(fqn: str, module: nn.Module, stop: Collection[int] = ()) -> Iterator[tuple[str, nn.Module]]:
    """A container cannot be a unit: shard its elements instead, except those
    already planned as units (``stop``): a container is uniform when its
    unsharded elements are, so it may hold elements sharded earlier."""
    if not is_container(module):
        yield fqn, module
        return
    for name, child in module._modules.items():
        if child is not None and id(child) not in stop:
            yield from _shardable(join_fqn(fqn, name), child, stop)


def _plan_target(
    r: _Resolver,
    fqn: str,
    keys: dict[int, DtypeKey],
    reshard: bool | int | None,
    is_root: bool,
) -> None:
    """Plan the dtype units of one target module (a block, or the root ``""``).

    1 (storage, compute) group -> the target alone; 2 groups -> every maximal
    subtree of the minority group alone, then the target with the majority;
    3+ -> every maximal uniform subtree alone, plus the target when it must
    keep ignored parameters (or is the root). Child units are internal (no
    ``output_dtype``); the target keeps the caller's boundary policy.
    """
    index = r.index
    target = index.module(fqn, "shard_by_dtype target")
    if id(target) in r.sharded:
        return
    kind: UnitKind = "root" if is_root else "block"
    order, parent, claimed = _survey(index, target, r.sharded)
    excluded = r.excluded
    counts: dict[DtypeKey, int] = {}
    for _f, p in claimed:
        if id(p) not in excluded:
            k = keys[id(p)]
            counts[k] = counts.get(k, 0) + 1
    has_ignored = len(claimed) > sum(counts.values())
    groups = list(counts)
    if len(groups) <= 1:
        if groups or is_root:
            r.add([target], kind, r.policy(groups[0][1] if groups else None, False), reshard, keys, claimed)
        return

    subtrees = _maximal_uniform_children(r, target, fqn, keys, order, parent)
    majority: DtypeKey | None = None
    if len(groups) == 2:
        # Fewest parameters is the minority; a tie is broken by the dtype
        # names, never by registration order, so every rank plans alike.
        minority = min(groups, key=lambda k: (counts[k], str(k)))
        majority = groups[0] if minority == groups[1] else groups[1]
        subtrees = [(f, m, k) for f, m, k in subtrees if k == minority]
    subtrees.sort(key=lambda item: item[0])
    reached_by_children: set[int] = set()
    for f, m, key in subtrees:
        policy = r.policy(key[1], True)  # type: ignore[index]
        for _cf, child in _shardable(f, m, r.sharded):
            child_claimed = claim(index, [child], r.sharded)
            reached_by_children.update(id(p) for _q, p in child_claimed)
            r.add([child], "dtype", policy, reshard, keys, child_claimed)
    if index.tied:  # a tied parameter may be reachable both inside and outside a child
        rest = claim(index, [target], r.sharded)
    else:  # otherwise the target now reaches exactly what its children no longer leave it
        rest = [(f, p) for f, p in claimed if id(p) not in reached_by_children]
    stray = [(f, keys[id(p)]) for f, p in rest if id(p) not in excluded and keys[id(p)] != majority]
    if stray:
        raise PlanningError(_isolation_message(stray, fqn))
    if majority is not None:
        r.add([target], kind, r.policy(majority[1], False), reshard, keys, rest)
    elif is_root or has_ignored:
        r.add([target], kind, r.policy(None, False), reshard, keys, rest)


def _survey(
    index: ModelIndex, target: nn.Module, stop: set[int]
) -> tuple[list[nn.Module], list[int], list[tuple[str, nn.Parameter]]]:
    """One walk of what ``fully_shard(target)`` would reach: the modules in
    pre-order with each one's parent position, and the claimed parameters
    (as :func:`claim`). The planner derives everything else from these lists
    instead of walking the subtree again."""
    param_fqn = index.param_fqn
    order: list[nn.Module] = []
    parent: list[int] = []
    claimed: list[tuple[str, nn.Parameter]] = []
    stack: list[tuple[nn.Module, int]] = [(target, -1)]
    while stack:
        m, up = stack.pop()
        if m is not target and id(m) in stop:
            continue
        here = len(order)
        order.append(m)
        parent.append(up)
        for p in m._parameters.values():
            if p is not None:
                claimed.append((param_fqn[id(p)], p))
        children = m._modules
        if children:
            stack.extend([(c, here) for c in reversed(children.values()) if c is not None])
    if index.shared_modules or index.aliases:
        claimed = _first_occurrences(claimed)
    return order, parent, claimed


_MIXED_KEY = object()


def _maximal_uniform_children(
    r: _Resolver,
    target: nn.Module,
    fqn: str,
    keys: dict[int, DtypeKey],
    order: list[nn.Module],
    parent: list[int],
) -> list[tuple[str, nn.Module, Hashable]]:
    """The maximal (storage, compute)-uniform proper subtrees of ``target``.

    On a tree (no module registered twice) the surveyed pre-order list is
    enough: children come after parents, so one backwards pass folds each
    module's key set into its parent's, and a uniform module is maximal
    exactly when its parent is mixed. A model with shared modules takes the
    general walk of :func:`maximal_uniform_subtrees`.
    """
    excluded = r.excluded
    if r.index.shared_modules:

        def key_of(m: nn.Module) -> list[Hashable]:
            return [keys[id(p)] for p in m._parameters.values() if p is not None and id(p) not in excluded]

        found = maximal_uniform_subtrees(target, key_of, fqn, stop=r.sharded)
        return [(f, m, k) for f, m, k in found if m is not target]
    state: list[object] = [None] * len(order)  # None: no parameter seen yet
    for i, m in enumerate(order):
        for p in m._parameters.values():
            if p is not None and id(p) not in excluded:
                k = keys[id(p)]
                if state[i] is None:
                    state[i] = k
                elif state[i] != k:
                    state[i] = _MIXED_KEY
                    break
    for i in range(len(order) - 1, 0, -1):
        folded, up = state[i], parent[i]
        if folded is None or state[up] is _MIXED_KEY:
            continue
        if state[up] is None:
            state[up] = folded
        elif state[up] != folded:
            state[up] = _MIXED_KEY
    fqn_of = r.index.fqn_of_module
    return [
        (fqn_of[id(order[i])], order[i], state[i])  # type: ignore[misc]
        for i in range(1, len(order))
        if state[i] is not None and state[i] is not _MIXED_KEY and state[parent[i]] is _MIXED_KEY
    ]


def _isolation_message(stray: list[tuple[str, DtypeKey]], target: str) -> str:
    owners = sorted({f.rpartition(".")[0] or "<root>" for f, _ in stray})
    listed = ", ".join(
        f"{f} ({str(k[0]).removeprefix('torch.')}->{str(k[1]).removeprefix('torch.')})" for f, k in stray
    )
    return (
        f"cannot give every parameter of {target or '<root>'!r} a dtype-uniform FSDP unit: "
        f"{listed} sit directly on module(s) {', '.join(owners)}, whose subtree also holds "
        "parameters of another (storage, compute) dtype, so no unit can hold them alone. Move "
        "them into a submodule of their own, give them one storage dtype, or pass them as "
        "ignored_params."
    )


def plan_dtype_units(
    r: _Resolver, request: DtypeRequest, fp32_tokens: Collection[str]
) -> None:
    index = r.index
    keys = param_keys(index, r.mp_policy, fp32_tokens)
    for fqn in request.ignored_params:
        p = index.param_named(fqn)
        if p is None:
            raise PlanningError(f"shard_by_dtype: ignored parameter {fqn!r} is not a parameter of the model")
        r.excluded.add(id(p))
    for fqn in request.targets:
        target = index.module(fqn, "shard_by_dtype target")
        if id(target) in index.sharded:
            raise PlanningError(
                f"shard_by_dtype: target {fqn or '<root>'!r} is already an FSDP module; plan the "
                "model before sharding it, or leave already-sharded modules out of blocks="
            )
        for element, _m in _shardable(fqn, target):  # a ModuleList target means its elements
            is_root = element == "" and request.always_shard_root
            _plan_target(r, element, keys, request.reshard_after_forward, is_root)


def plan_cross_block_units(
    r: _Resolver, blocks: Sequence[str], names: Sequence[str]
) -> None:
    """One unit per dotted name, spanning every block's instance of it.

    Holders whose forward ignores its input never trigger FSDP2's per-unit
    post-backward hook, so each would be reduce-scattered alone after the whole
    backward; one unit across blocks makes that one collective, and keeping it
    unsharded after forward (a few KiB) avoids a re-gather per block and per
    checkpoint recompute.
    """
    index = r.index
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise PlanningError(f"shard_across_blocks: module names {repeated} are listed more than once")
    policy = r.policy(torch.float32, True)
    block_modules = [(b, unwrap_checkpoint(index.module(b, "shard_across_blocks block"))) for b in blocks]
    for name in names:
        found: list[nn.Module] = []
        for _b, block in block_modules:
            try:
                found.append(get_module_from_path(block, name))
            except AttributeError:
                continue
        if not found:
            raise PlanningError(
                f"shard_across_blocks: no block has a submodule {name!r} "
                f"(searched {len(blocks)} blocks: {_preview(blocks)}); fix the name in "
                "_fsdp_shard_across_blocks or module_names="
            )
        claimed = claim(index, found, r.sharded)
        bad = [(f, p.dtype) for f, p in claimed if p.dtype != torch.float32 and id(p) not in r.excluded]
        if bad:
            raise PlanningError(
                f"shard_across_blocks: {name!r} must hold only fp32 parameters (its unit computes "
                "and reduces in fp32), but "
                + ", ".join(f"{f} is {str(d).removeprefix('torch.')}" for f, d in bad)
                + "; store them in fp32 or drop the name from the cross-block list"
            )
        keys = {id(p): (p.dtype, p.dtype) for _f, p in claimed}  # all fp32, computing in fp32
        unit = r.add(found, "cross-block", policy, False, keys, claimed)
        if not unit.params:
            raise PlanningError(
                f"shard_across_blocks: {name!r} matched {len(found)} modules but they hold no "
                "parameter not already owned by another unit"
            )


def _preview(items: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(i) for i in items[:n])
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")


def resolve_units(
    model: nn.Module,
    *,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    cross_blocks: Sequence[CrossBlockRequest],
    dtype_request: DtypeRequest | None,
    index: ModelIndex | None = None,
) -> tuple[Unit, ...]:
    """All units, in application order: cross-block units first (their
    holders are excluded from dtype grouping whatever the transform order),
    then each dtype target's children before the target itself."""
    idx = index or ModelIndex.build(model)
    r = _Resolver(idx, mp_policy, offload_policy, excluded=set(), sharded=set(idx.sharded))
    for req in cross_blocks:
        plan_cross_block_units(r, req.blocks, req.names)
    if dtype_request is not None:
        plan_dtype_units(r, dtype_request, dtype_request.fp32_compute_module_names)
    return tuple(r.units)


def _natural(fqn: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key reading index segments as numbers: ``layers.2`` before ``layers.10``."""
    return tuple((0, int(seg)) if seg.isdigit() else (1, seg) for seg in fqn.split("."))


def discover_blocks(model: nn.Module, index: ModelIndex | None = None) -> tuple[str, ...]:
    """The model's repeated blocks, by the conventions models already declare.

    ``_no_split_modules`` class names (Hugging Face's marker for "keep this
    module whole") win; a block wrapped for activation checkpointing is taken
    with its wrapper. Otherwise the elements of the largest ``nn.ModuleList``.
    Matches nested inside another match are not blocks of their own. Blocks
    come in index order (``layers.2`` before ``layers.10``), not registration
    order, so every rank lists them alike.
    """
    idx = index or ModelIndex.build(model)
    class_names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[str] = []
    if class_names:
        for fqn, module in idx.modules.items():
            if type(module).__name__ not in class_names or not fqn:
                continue
            parent, _, leaf = fqn.rpartition(".")
            if leaf == "_checkpoint_wrapped_module":
                fqn = parent
            if not any(fqn.startswith(f + ".") for f in found[-1:]):
                found.append(fqn)
        if found:
            return tuple(sorted(found, key=_natural))
    best: tuple[str, nn.Module] | None = None
    for fqn, module in idx.modules.items():
        if type(module) is nn.ModuleList and (best is None or len(module._modules) > len(best[1]._modules)):
            best = (fqn, module)
    if best is None:
        return ()
    return tuple(join_fqn(best[0], n) for n, c in best[1]._modules.items() if c is not None)
