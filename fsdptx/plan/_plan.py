"""The Plan: immutable, comparable, printable description of how to shard a model.

A Plan names modules and parameters by FQN only (never by object), so it can be
built without touching the model, compared in tests, printed for review, and
applied later by :func:`fsdptx.apply_plan`. Its records are
:mod:`fsdptx.plan._types`; printing it is :mod:`fsdptx.plan._format`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ._format import format_plan
from ._types import (
    Checkpointing,
    CrossBlockRequest,
    DtypeRequest,
    ExpertParallel,
    FrozenReductions,
    Prefetch,
    Reduction,
    TensorParallel,
    Unit,
    Verification,
)

if TYPE_CHECKING:
    # For the annotation of Plan.scratch only: model is below plan, so this
    # is no upward edge, and nothing is imported at run time.
    from ..model._index import ModelIndex

__all__ = ["Pipeline", "Placement", "Plan", "Stage"]

Placement = Literal["loop", "v"]


@dataclass(frozen=True)
class Plan:
    """Immutable result of planning; ``units`` are in application order
    (children before parents). ``reductions`` maps parameter FQN to its
    TP-replica gradient reduction; ``exclusions`` are module FQNs whose subtree
    stays rank-local. ``mp_policy``/``offload_policy``/``reshard_after_forward``
    are the defaults transforms start from (``None`` policy: mixed precision
    disabled).

    Attributes:
        units: the FSDP units, in application order.
        reductions: parameter FQN -> ``"mean"`` or ``"sum"``.
        exclusions: module FQNs kept out of TP-replica sync.
        mp_policy: the default policy transforms start from.
        offload_policy: the default offload policy.
        reshard_after_forward: the default reshard setting.
        dtype_request: what ``shard_by_dtype`` asked for, if anything.
        cross_block_requests: what ``shard_across_blocks`` asked for.
        tensor_parallel: the TP request, resolved per module.
        checkpointing: the activation-checkpointing request.
        prefetch: the explicit prefetch chains.
        reduce_unused_params: whether units reduce-scatter zeros for unused
            parameters.
        expert_modules: module FQNs of experts, sharded over the MoE mesh.
        warnings: what a reader must know before trusting the plan.
        scratch: planning's model index; ``None`` outside ``plan()``.
        verified: what planning vouched for; not part of the value.

    Example::

        p = fsdptx.plan(model, fsdptx.shard_by_dtype)
        print(p)  # one row per unit
        assert p == fsdptx.plan_from_json(fsdptx.plan_to_json(p))
    """

    units: tuple[Unit, ...] = ()
    reductions: Mapping[str, Reduction] = field(default_factory=FrozenReductions)
    exclusions: tuple[str, ...] = ()
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = field(default=None, hash=False)
    reshard_after_forward: bool | int | None = None
    dtype_request: DtypeRequest | None = None
    cross_block_requests: tuple[CrossBlockRequest, ...] = ()
    tensor_parallel: TensorParallel | None = None
    checkpointing: Checkpointing | None = None
    prefetch: tuple[Prefetch, ...] = ()
    # Refinement for context parallelism: a CP rank may not use every
    # parameter, so units reduce-scatter zeros for unused ones (no hang).
    reduce_unused_params: bool = False
    # Module FQN globs of expert modules, sharded over the MoE mesh.
    expert_modules: tuple[str, ...] = ()
    # Experts split by expert across the MoE mesh's ``ep`` dim.
    expert_parallel: ExpertParallel | None = None
    # Pipeline stages, each with its own Plan; None without pipeline
    # parallelism. A pipelined Plan's own units are empty: every unit
    # belongs to a stage.
    pipeline: Pipeline | None = None
    # What a reader must know before trusting the plan (no blocks found,
    # say); str(plan) prints these first and FSDP2Manager logs them.
    warnings: tuple[str, ...] = ()
    # Read-only index of the model being planned, shared by the transforms of
    # one fsdptx.plan() call so the model is walked once; plan() drops it
    # before returning. Not part of the Plan's value.
    scratch: ModelIndex | None = field(default=None, compare=False, repr=False)
    # What planning vouches for (fsdptx.plan._vouch.Vouched): the
    # signature of the model these very units were resolved against, so
    # apply_plan can skip re-deriving their claims while the model is
    # unchanged. Not part of the Plan's value; new units drop its use.
    verified: Verification | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "exclusions", tuple(self.exclusions))
        object.__setattr__(self, "prefetch", tuple(self.prefetch))
        if not isinstance(self.reductions, FrozenReductions):
            object.__setattr__(self, "reductions", FrozenReductions(self.reductions))

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles leave ``scratch`` and ``verified`` behind: both
        refer to live objects of this process, so a copy is checked in full."""
        return {**self.__dict__, "scratch": None, "verified": None}

    def replace(self, **changes: Any) -> Plan:
        """A copy with ``changes``; the Plan itself never changes."""
        return dataclasses.replace(self, **changes)

    @property
    def owned_params(self) -> dict[str, int]:
        """Parameter FQN -> index of the unit that owns it."""
        return {p: i for i, u in enumerate(self.units) for p in u.params}

    def __str__(self) -> str:
        return format_plan(self)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a Plan.

    Attributes:
        index: the stage's place in the pipeline (0 runs first).
        rank: the pipeline rank (coordinate on the mesh's ``pp`` dim) running it.
        modules: the parts it holds, module FQNs of the whole model.
        plan: the stage's own Plan (units, TP, checkpointing), planned on
            the stage's module; its FQNs are the whole model's.
        numel: parameter elements the stage holds (tied ones once).
        nbytes: their bytes at their storage dtypes.

    Example::

        first = manager.plan(model).pipeline.stages[0]
        print(first.rank, first.modules, first.plan)  # the stage's own units
    """

    index: int
    rank: int
    modules: tuple[str, ...]
    plan: Plan
    numel: int
    nbytes: int


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of a Plan: how its stages are scheduled.

    Attributes:
        schedule: the torch schedule name.
        microbatches: micro-batches per optimizer step.
        size: pipeline ranks (the ``pp`` dim's size).
        stages_per_rank: stages per pipeline rank.
        placement: ``"loop"`` or ``"v"``.
        container: the FQN of the module holding the blocks the stages split.
        stages: every stage, in pipeline order.

    Example::

        p = manager.plan(model)           # FSDP2Config(pipeline_parallel=...)
        for stage in p.pipeline.stages_of(rank=0):
            print(stage.index, stage.modules)
    """

    schedule: str
    microbatches: int
    size: int
    stages_per_rank: int
    placement: Placement
    container: str
    stages: tuple[Stage, ...] = field(default=())

    def stages_of(self, rank: int) -> tuple[Stage, ...]:
        """The stages pipeline rank ``rank`` runs, in pipeline order."""
        return tuple(s for s in self.stages if s.rank == rank)
