"""The resolver: the per-resolution state (:class:`_Resolver`) every planner
of :mod:`fsdptx.plan.resolve` records its units in.

It owns the bookkeeping a unit changes (which parameters are taken, which
modules are sharded, which ignored parameters each module must forward),
so the planners above it (:mod:`._target`, :mod:`._cross_block`,
:mod:`._dtype_units`) decide what to shard and never track it themselves.
It builds on :mod:`._claim` and :mod:`._keys` only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ...core._caches import memoized
from ...model._index import ModelIndex, PlanningError
from .._types import Unit, UnitKind
from ._claim import claim
from ._keys import DtypeKey, unit_policy

@dataclass
class _Resolver:
    """Mutable scratch state for one resolution; never escapes ``resolve_units``."""

    index: ModelIndex
    mp_policy: MixedPrecisionPolicy | None
    offload_policy: OffloadPolicy | None
    excluded: set[int]  # params owned elsewhere or ignored: never grouped, never claimed
    sharded: set[int]  # modules that are, or will be by then, FSDP modules
    keys: dict[int, DtypeKey] = field(default_factory=dict)  # floating params' (storage, compute)
    frozen: set[int] = field(default_factory=set)  # floating params without requires_grad
    intrinsic: set[int] = field(default_factory=set)  # fp32 params computing fp32 because the bulk is lower precision
    bulk: torch.dtype | None = None  # that bulk's storage dtype, for the units' reasons
    ignored: set[int] = field(default_factory=set)  # the request's ignored params
    ignored_under: dict[str, set[str]] = field(default_factory=dict)  # module FQN -> ignored params below
    units: list[Unit] = field(default_factory=list)
    owner: dict[int, int] = field(default_factory=dict)  # param id -> unit index

    def __post_init__(self) -> None:
        # Read once per resolution: with caches off, every read of the
        # index's table computes it again, and this runs for every unit.
        self.facts = self.index.param_facts
        # Thousands of units share a handful of policies.
        self.policy_for: Callable[[tuple[torch.dtype | None, bool]], MixedPrecisionPolicy | None] = memoized(
            functools.partial(unit_policy, self.mp_policy)
        )

    def policy(self, compute: torch.dtype | None, internal: bool) -> MixedPrecisionPolicy | None:
        """The policy for a unit computing in ``compute`` (:func:`unit_policy`)."""
        return self.policy_for((compute, internal))

    def add(
        self,
        modules: Sequence[nn.Module],
        kind: UnitKind,
        policy: MixedPrecisionPolicy | None,
        reshard: bool | int | None,
        claimed: list[tuple[str, nn.Parameter]] | None = None,
        also_ignored: Collection[str] = (),
    ) -> Unit:
        """Record a unit owning what ``fully_shard(modules)`` would claim now
        (``claimed``, when the caller has just computed it).

        Its dtypes are those of its trainable parameters (frozen ones ride
        along: FSDP2 only asks trainable parameters to agree). Its ignored
        parameters are those it reaches, plus ``also_ignored``: the ignored
        parameters below units nested in it by the same request, which the
        seed forwards to the enclosing unit.
        """
        if claimed is None:
            claimed = claim(self.index, modules, self.sharded)
        here = [self.index.fqn_of(m) for m in modules]
        excluded, owner, position, keys, frozen = self.excluded, self.owner, len(self.units), self.keys, self.frozen
        facts = self.facts
        params: list[str] = []
        ignored: set[str] = set()
        unit_keys: set[DtypeKey] = set()
        frozen_keys: set[DtypeKey] = set()
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
                ignored.add(f)
                continue
            params.append(f)
            key = keys.get(pid)
            if key is not None:
                (frozen_keys if pid in frozen else unit_keys).add(key)
            _dtype, n, b, _hint, _grad = facts[pid]
            numel += n
            nbytes += b
            excluded.add(pid)
            owner[pid] = position
        ignored.update(also_ignored)
        params.sort()  # FQN order: a unit is a set, and its listing must not
        unit_keys = unit_keys or frozen_keys  # depend on the order a rank registered modules in
        storage = {k[0] for k in unit_keys}
        compute = {k[1] for k in unit_keys}
        reasons: list[str] = []
        if self.intrinsic and any(id(p) in self.intrinsic for _f, p in claimed):
            reasons.append(f"fp32: intrinsic, {str(self.bulk).removeprefix('torch.')} bulk")
        if kind == "dtype" and compute == {torch.float32} and all(_is_leaf(m) for m in modules):
            # A parameter holder's forward may hand out its own parameter
            # (attention sinks that ignore their input): resharding after
            # forward would free the storage the caller still holds. Holders
            # are small, so they stay gathered, as the cross-block unit does.
            reshard = False
            reasons.append("gathered: holder may return its parameter")
        unit = Unit(
            modules=tuple(here),
            params=tuple(params),
            ignored_params=tuple(sorted(ignored)),
            kind=kind,
            storage_dtype=storage.pop() if len(storage) == 1 else None,
            compute_dtype=compute.pop() if len(compute) == 1 else None,
            mp_policy=policy,
            offload_policy=self.offload_policy,
            reshard_after_forward=reshard,
            numel=numel,
            nbytes=nbytes,
            reasons=tuple(reasons),
        )
        self.units.append(unit)
        self.sharded.update(id(m) for m in modules)
        return unit

    def ignore(self, fqns: Sequence[str]) -> None:
        """Exclude the named parameters from every unit and remember, for each
        module above one, which it may have to forward as ``ignored_params``."""
        index = self.index
        for fqn in fqns:
            p = index.param_named(fqn)
            if p is None:
                raise PlanningError(f"shard_by_dtype: ignored parameter {fqn!r} is not a parameter of the model")
            self.excluded.add(id(p))
            self.ignored.add(id(p))
            canonical = index.param_fqn[id(p)]
            for name in index.names(p):
                module = name.rpartition(".")[0]
                while True:
                    self.ignored_under.setdefault(module, set()).add(canonical)
                    if not module:
                        break
                    module = module.rpartition(".")[0]

def _is_leaf(module: nn.Module) -> bool:
    """Whether ``module`` has no submodules: a plain parameter holder."""
    return not any(c is not None for c in module._modules.values())
