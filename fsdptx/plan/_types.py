"""The records a Plan is made of: units, the requests transforms keep,
tensor/expert parallelism, checkpointing, prefetch, TP-replica reductions,
and the few helpers every layer reads them with.

Like the Plan (:mod:`fsdptx.plan._plan`), every record names modules and
parameters by FQN only, never by object, and is immutable and comparable.
This module imports no other fsdptx module but :mod:`fsdptx.plan._style_data`
(which imports none), so anything in fsdptx can import it without a cycle;
rendering a Plan as text is :mod:`fsdptx.plan._format`.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, Mapping, Sequence, ValuesView
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeGuard

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from ._style_data import style_settings

__all__ = [
    "Checkpointing",
    "CrossBlockRequest",
    "DtypeRequest",
    "ExpertParallel",
    "Prefetch",
    "REDUCTIONS",
    "Reduction",
    "StreamStep",
    "TPAssignment",
    "TensorParallel",
    "Unit",
    "UnitKind",
    "UnitMesh",
    "Verification",
    "is_reduction",
]

Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum")


def is_reduction(value: object) -> TypeGuard[Reduction]:
    """Whether ``value`` is one of :data:`REDUCTIONS` (so typed as one)."""
    return value in REDUCTIONS

UnitKind = Literal["cross-block", "dtype", "block", "expert", "root"]
# Which mesh a unit shards over: the dense data-parallel mesh, or the MoE
# mesh's data-parallel dims (expert modules, whose ranks are laid out for
# expert parallelism).
UnitMesh = Literal["dp", "moe"]
CheckpointMode = Literal["full", "selective"]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: one call of the sharding primitive.

    ``modules`` has one FQN for an ordinary unit and several for a unit that
    spans modules (one ``fully_shard([...])`` call, one parameter group).
    ``params`` are the parameter FQNs the unit will own: exactly what the
    primitive claims given ``ignored_params`` and the units applied before it.

    Attributes:
        modules: the module FQNs the unit spans (``""`` is the root).
        params: the parameter FQNs it owns.
        ignored_params: parameter FQNs under it that another unit owns.
        kind: ``"cross-block"``, ``"dtype"``, ``"block"``, ``"expert"`` or
            ``"root"``.
        storage_dtype: the dtype its trainable parameters are stored in.
        compute_dtype: the dtype they compute in (the policy's
            ``param_dtype``).
        mp_policy: the unit's policy; ``None`` means disabled.
        offload_policy: the unit's offload policy.
        reshard_after_forward: ``None`` (FSDP2's default), a bool, or a group
            size.
        numel: elements owned.
        nbytes: bytes owned, at the storage dtype.
        mesh: ``"dp"`` or ``"moe"`` (expert units).
        reasons: why the planner chose what the policy alone would not say.

    Example::

        unit = p.units[0]
        print(unit.kind, unit.modules, unit.compute_dtype)
    """

    modules: tuple[str, ...]
    params: tuple[str, ...]
    ignored_params: tuple[str, ...]
    kind: UnitKind
    storage_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None
    mp_policy: MixedPrecisionPolicy | None
    # torch's offload policies are mutable dataclasses, so unhashable: they
    # count for equality but not for the hash (equal plans still hash alike).
    offload_policy: OffloadPolicy | None = field(hash=False)
    reshard_after_forward: bool | int | None
    numel: int
    nbytes: int
    mesh: UnitMesh = "dp"
    # Why the planner chose what a reader would not expect from the policy
    # alone (e.g. "fp32: intrinsic, bfloat16 bulk"; "gathered: holder may
    # return its parameter"); shown in str(plan).
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class DtypeRequest:
    """What :func:`fsdptx.shard_by_dtype` asked for, kept in the Plan so that a
    later transform that claims parameters (``shard_across_blocks``) can
    re-resolve the dtype units; this is what makes ``compose`` order-free."""

    targets: tuple[str, ...]
    fp32_compute_module_names: tuple[str, ...]
    ignored_params: tuple[str, ...]
    reshard_after_forward: bool | int | None
    # The model root ("") always gets a unit in a pipeline: FSDP2's root unit
    # drives lazy init and owns what no block owns. A single module sharded by
    # fully_shard_by_dtype is not the model root and gets one only if needed.
    always_shard_root: bool = True


@dataclass(frozen=True)
class CrossBlockRequest:
    """What :func:`fsdptx.shard_across_blocks` asked for: one unit per name
    in ``names``, spanning that submodule of every block in ``blocks``."""

    blocks: tuple[str, ...]
    names: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class TPAssignment:
    """One module's tensor-parallel style, resolved from a pattern of the
    request to a concrete module FQN. ``style`` is the readable name the Plan
    shows; ``parallel_style`` is the torch object handed to
    ``parallelize_module``. torch styles define no equality and the name
    leaves settings out (``use_local_output``, desired layouts, ...), so
    what compares and hashes beside module, name and pattern is
    ``settings``: the style's class and every attribute (what applying a
    style records on it, such as ``src_data_rank``, left out), derived the
    first time it is read.

    Attributes:
        module: the module FQN the style applies to.
        style: the style's readable name (compared and printed).
        pattern: the request's glob that matched ``module``.
        parallel_style: the torch ``ParallelStyle`` object applied.
        settings: the style as canonical JSON
            (:func:`fsdptx.plan._style_data.style_settings`); derived, not
            an argument.

    Example::

        styles = {a.module: a.style for a in p.tensor_parallel.assignments}
    """

    module: str
    style: str
    pattern: str
    parallel_style: ParallelStyle = field(compare=False, repr=False, hash=False)

    @property
    def settings(self) -> str:
        """Derived on first use and kept: planning makes thousands of
        assignments and compares none of them."""
        found: str | None = self.__dict__.get("_settings")
        if found is None:
            found = style_settings(self.parallel_style)
            object.__setattr__(self, "_settings", found)
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TPAssignment):
            return NotImplemented
        return (self.module, self.style, self.pattern, self.settings) == (
            other.module,
            other.style,
            other.pattern,
            other.settings,
        )

    def __hash__(self) -> int:
        return hash((self.module, self.style, self.pattern, self.settings))


@dataclass(frozen=True)
class StreamStep:
    """One module on the residual stream, as the sequence-layout pass saw
    it (in the order it walks: blocks in forward order, a block's children
    in registration order): its role (``embedding``, ``block``,
    ``norm``, ``region``, ``holder``, ``head``), the layout it receives and
    hands on (``whole``, ``Shard(1)``, ``Shard(-1) vocab``; ``DTensor`` when
    it is one), and the boundary the pass added there, if any."""

    module: str
    role: str
    takes: str
    gives: str
    added: str | None = None


@dataclass(frozen=True)
class TensorParallel:
    """What :func:`fsdptx.tensor_parallel` asked for: one assignment per
    module, in FQN order. ``skipped`` lists declared entries that are not
    applied as a torch style (pattern, style, why): for example Hugging
    Face's ``replicated_with_grad_allreduce``, which becomes a TP-replica
    reduction mark instead. ``stream`` is the residual stream's layout at
    each module, in the order the sequence-layout pass walks it (the
    blocks in forward order, a block's children in registration order,
    which its forward need not follow); ``loss_parallel`` whether the head
    keeps its logits vocabulary-sharded.

    Attributes:
        assignments: one per module, in FQN order.
        sequence_parallel: whether the residual stream is sequence-sharded.
        skipped: ``(pattern, style, why)`` of declared entries not applied
            as a torch style.
        loss_parallel: whether the head keeps its logits vocabulary-sharded.
        stream: the residual stream's layout at each module, in the
            pass's order (blocks forward, a block's children as registered).

    Example::

        tp = fsdptx.plan(model, functools.partial(fsdptx.tensor_parallel, sequence_parallel=True)).tensor_parallel
        assert tp is not None and tp.sequence_parallel
    """

    assignments: tuple[TPAssignment, ...]
    sequence_parallel: bool
    skipped: tuple[tuple[str, str, str], ...] = ()
    loss_parallel: bool = False
    stream: tuple[StreamStep, ...] = ()


@dataclass(frozen=True)
class ExpertParallel:
    """Expert parallelism: each expert module's parameters are split on
    dim 0, their expert dim, across the MoE mesh's ``ep`` dim, so each EP
    rank holds ``num_experts / ep`` whole experts; FSDP then shards those
    over the MoE mesh's data-parallel dims.

    ``modules`` are the expert modules (FQNs) and ``num_experts`` their
    expert counts, in the same order; ``params`` every parameter split.
    Sending each token to the rank that holds its expert (an all-to-all
    along ``ep``) is the model's own forward: ``apply_plan`` hands each
    expert module the ``ep`` mesh (see :mod:`fsdptx.apply._experts`).

    Attributes:
        modules: the expert modules' FQNs.
        num_experts: each one's expert count, in the same order.
        params: every parameter split on its expert dim.

    Example::

        ep = manager.plan(model).expert_parallel   # FSDP2Manager with moe_mesh ep > 1
        print(ep.modules, ep.num_experts)
    """

    modules: tuple[str, ...]
    num_experts: tuple[int, ...]
    params: tuple[str, ...]


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing requested for ``modules`` (the blocks).

    A forward that fills a KV cache cannot be recomputed, so applying
    checkpointing turns the model's caches off; ``kv_cache_off`` lists the
    switches that were on at planning, and applying refuses a model that
    has one on the Plan does not list (it changed since planning).

    Attributes:
        mode: ``"full"`` or ``"selective"``.
        modules: the block FQNs checkpointed.
        kv_cache_off: the ``use_cache`` switches applying turns off (paths
            such as ``model.config.use_cache``).

    Example::

        if p.checkpointing is not None:
            print(p.checkpointing.mode, len(p.checkpointing.modules))
    """

    mode: CheckpointMode
    modules: tuple[str, ...]
    kv_cache_off: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prefetch:
    """Explicit FSDP prefetch chain of one unit (named by its first module):
    which units it all-gathers ahead of time in forward and in backward.

    Attributes:
        unit: the first module of the unit that prefetches.
        forward: the units (by first module) it all-gathers ahead in forward.
        backward: the units it all-gathers ahead in backward.

    Example::

        chains = {c.unit: c.forward for c in p.prefetch}
    """

    unit: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]


class FrozenReductions(Mapping[str, Reduction]):
    """Parameter FQN -> reduction, immutable, in FQN order; unlike a
    ``MappingProxyType`` it pickles and deep-copies, so a Plan can be sent
    between processes or kept for later."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Reduction] | None = None) -> None:
        self._items: dict[str, Reduction] = dict(sorted((items or {}).items()))
        # Refused here, where every Plan's marks pass: a typo such as "max"
        # would otherwise be synchronized as some other reduction.
        bad = {k: v for k, v in self._items.items() if v not in REDUCTIONS}
        if bad:
            raise ValueError(f"unknown TP-replica reduction(s) {bad}; each must be one of {REDUCTIONS}")

    def __getitem__(self, key: str) -> Reduction:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    # The dict's own read-only views: Mapping's generic ones look every
    # key up again, and apply_plan reads every mark of a large plan.
    def items(self) -> ItemsView[str, Reduction]:
        return self._items.items()

    def keys(self) -> KeysView[str]:
        return self._items.keys()

    def values(self) -> ValuesView[Reduction]:
        return self._items.values()

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenReductions({self._items!r})"

    def __reduce__(self) -> tuple[type[FrozenReductions], tuple[dict[str, Reduction]]]:
        return (FrozenReductions, (self._items,))


class Verification(Protocol):
    """What a Plan's ``verified`` holds: :class:`fsdptx.plan._vouch.Vouched`,
    described here by what every reader checks first (that it vouches for
    these very ``units``), since ``_vouch`` imports this module and
    :mod:`fsdptx.plan._plan`, so the class itself cannot be named in either
    without a cycle."""

    @property
    def units(self) -> tuple[Unit, ...]: ...


def preview(items: Sequence[str], n: int = 3) -> str:
    """The first ``n`` names for an error message, and how many there are."""
    shown = ", ".join(repr(i) for i in items[:n])
    return shown + (f", ... ({len(items)} in all)" if len(items) > n else "")


def marks_under_exclusions(
    reductions: Mapping[str, Reduction], exclusions: tuple[str, ...], experts: tuple[str, ...] = ()
) -> str | None:
    """The problem, if any, of reduction marks on parameters inside
    excluded modules: TP-replica sync skips excluded subtrees, so such a
    mark would silently never be applied (a ``sum`` that sequence
    parallelism derives for experts the expert exclusion keeps rank-local,
    say), and the replicas would drift apart."""
    if not exclusions or not reductions:
        return None
    excluded = set(exclusions)
    found: list[str] = []
    inside: dict[str, None] = {}
    for name in reductions:
        prefixes = [name.rpartition(".")[0]]
        while prefixes[-1]:
            prefixes.append(prefixes[-1].rpartition(".")[0])
        hit = next((m for m in prefixes if m in excluded), None)
        if hit is not None:
            found.append(name)
            inside[hit] = None
    if not found:
        return None
    problem = (
        f"parameters {preview(found)} carry TP-replica reduction marks but lie in {preview(list(inside))}, "
        "which the plan excludes from "
        "TP-replica sync, so the marks would never be applied; drop the marks or the exclusions"
    )
    if set(inside) & set(experts):
        problem += (
            ". Expert modules are excluded (their shards may differ between TP ranks); under sequence "
            "parallelism their TP replicas see different tokens and would need a sum that fsdptx does not apply "
            "to experts: use sequence_parallel=False for such a model"
        )
    return problem


def reshards_after_forward(unit: Unit) -> bool:
    """Whether FSDP2 will free the unit's gathered parameters after forward
    (and gather them again for backward). ``None`` is FSDP2's default: True,
    except for the FSDP root (the model root ``""``), which keeps them since
    backward needs them at once. An int is a group size to reshard to; FSDP2
    turns ``1`` into False."""
    r = unit.reshard_after_forward
    if r is None:
        return unit.modules != ("",)
    if isinstance(r, bool):
        return r
    return r != 1
