"""Pure transforms ``(model, Plan) -> Plan`` and their combinator.

Each transform is usable bare (its defaults come from what the model declares)
or configured with keyword-only options through ``functools.partial``. None of
them touches the model: they read it and return a new Plan.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Concatenate, ParamSpec, Protocol

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from ..core._args import require_module
from ..core._names import Names, name_tokens, natural_key
from ..core._policy import check_policy_dtypes
from ..hf import hf_fp32_compute_tokens, hf_replica_reductions
from ..model._index import ModelIndex, PlanningError, resolve_blocks
from ._kinds import reads_no_units as _reads_no_units, request_of as _request_of, request_transform, unit_blind
from ._resolve import resolve_units
from ._types import REDUCTIONS, CrossBlockRequest, DtypeRequest, Plan, Reduction, Unit, is_reduction, marks_under_exclusions, preview
from ._vouch import vouch, vouch_marks

__all__ = [
    "Transform",
    "compose",
    "mark_reduction",
    "plan",
    "shard_across_blocks",
    "shard_by_dtype",
]

_P = ParamSpec("_P")


class Transform(Protocol):
    """Reads a model and returns a new Plan; never mutates either.

    The sharding transforms resolve ``Plan.units`` from the requests recorded
    in the Plan, replacing whatever units it held: a transform of your own that
    edits units should run after them.

    Example::

        def no_reshard(model: nn.Module, plan: fsdptx.Plan, /) -> fsdptx.Plan:
            return plan.replace(units=tuple(dataclasses.replace(u, reshard_after_forward=False) for u in plan.units))

        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, no_reshard))
    """

    def __call__(self, model: nn.Module, plan: Plan, /) -> Plan: ...


def transform_name(t: object) -> str:
    """A readable name for a transform, seeing through ``functools.partial``."""
    if isinstance(t, functools.partial):
        return f"partial({transform_name(t.func)}, ...)"
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or repr(t)


def _checked(t: Transform, model: nn.Module, p: Plan) -> Plan:
    result = t(model, p)
    if not isinstance(result, Plan):
        raise TypeError(
            f"transform {transform_name(t)} returned {type(result).__name__}, not a Plan; "
            "a transform must return the new Plan (e.g. plan.replace(...))"
        )
    return result


def compose(*transforms: Transform) -> Transform:
    """Chain transforms left to right into one transform.

    For ``shard_by_dtype``, ``shard_across_blocks`` and ``mark_reduction`` the
    result does not depend on argument order: cross-block units always own their
    holders and dtype units always exclude them, because units are resolved
    from the sharding requests recorded in the Plan, never patched.

    Consecutive sharding transforms (bare or ``functools.partial`` with
    keywords; ``mark_reduction`` between them does not interrupt the run) are
    fused: their requests are recorded and the units resolved once. The Plan
    is the one applying them one by one gives; only an intermediate state
    that cannot be planned on its own (say, blocks whose fp32 holders are
    isolable only once a cross-block unit owns them) is never resolved.

    Args:
        *transforms: transforms, applied left to right.

    Returns:
        One transform; a Plan that went through it never depends on the
        order of the sharding transforms among ``transforms``.

    Raises:
        TypeError: a transform is not callable (here), or one returns
            something other than a Plan (when the pipeline runs).

    Example::

        pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
        p = fsdptx.plan(model, pipeline)
    """

    for i, t in enumerate(transforms):
        if not callable(t):
            raise TypeError(
                f"compose: transform {i} must be callable (model, Plan) -> Plan, got {type(t).__name__} {t!r}"
            )

    def composed(model: nn.Module, p: Plan, /) -> Plan:
        own_scratch = not isinstance(p.scratch, ModelIndex)
        if own_scratch:
            p = p.replace(scratch=ModelIndex.build(model))
        pending = False
        for t in transforms:
            request = _request_of(t)
            if request is not None:
                fn, options = request
                p = fn(model, p, **options)
                pending = True
                continue
            if pending and not _reads_no_units(t):
                p, pending = _resolve(model, p, model_index(model, p)), False
            p = _checked(t, model, p)
        if pending:
            p = _resolve(model, p, model_index(model, p))
        return p.replace(scratch=None) if own_scratch else p

    composed.__qualname__ = "compose(" + ", ".join(transform_name(t) for t in transforms) + ")"
    return composed


def plan(
    model: nn.Module,
    transform: Transform,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> Plan:
    """Run ``transform`` on an empty Plan carrying these defaults.

    ``mp_policy=None`` means mixed precision disabled. Pure: the model is only
    read, so this is safe on a meta-device skeleton or a live model alike.

    Args:
        model: the model to plan for; only read (a meta-device model works).
        transform: a transform, usually a :func:`compose` pipeline.
        mp_policy: the default policy units start from.
        offload_policy: the default offload policy of every unit.
        reshard_after_forward: the default reshard setting (``None``:
            FSDP2's default, refined by :func:`reshard_policy`).

    Returns:
        The Plan, with what planning vouched for, so ``apply_plan`` on the
        unchanged model skips re-deriving each unit's claims.

    Raises:
        TypeError: an argument has the wrong type, or the transform returns
            something other than a Plan.
        PlanningError: the request cannot be planned for this model (nothing
            about the model is changed).

    Example::

        p = fsdptx.plan(model, fsdptx.shard_by_dtype, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        print(p)
    """
    require_module(model, "model", "plan")
    return plan_indexed(
        model,
        transform,
        ModelIndex.build(model),
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
    )


def plan_indexed(
    model: nn.Module,
    transform: Transform,
    index: ModelIndex,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
) -> Plan:
    """:func:`plan` reading ``index``, the model's index built a moment ago
    (the manager hands the same index on to ``apply_plan``'s checks, so
    ``parallelize`` walks its model once)."""
    require_module(model, "model", "plan")
    if not callable(transform):
        raise TypeError(f"plan: transform must be callable (model, Plan) -> Plan, got {type(transform).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"plan: mp_policy must be a MixedPrecisionPolicy or None, got {mp_policy!r}")
    check_policy_dtypes(mp_policy, "plan")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"plan: offload_policy must be an OffloadPolicy or None, got {offload_policy!r}")
    start = Plan(
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        reshard_after_forward=reshard_after_forward,
        scratch=index,
    )
    planned = _checked(transform, model, start)
    problem = marks_under_exclusions(planned.reductions, planned.exclusions, planned.expert_modules)
    if problem is not None:
        raise PlanningError(f"plan: {problem}")
    return planned.replace(scratch=None, verified=vouch_marks(model_index(model, planned), planned))


def model_index(model: nn.Module, p: Plan) -> ModelIndex:
    """The index shared through ``plan()``, or a fresh one for a transform
    called on its own."""
    if isinstance(p.scratch, ModelIndex) and p.scratch.root is model:
        return p.scratch
    return ModelIndex.build(model)


def _resolve(model: nn.Module, p: Plan, index: ModelIndex) -> Plan:
    units = resolve_units(
        model,
        mp_policy=p.mp_policy,
        offload_policy=p.offload_policy,
        cross_blocks=p.cross_block_requests,
        dtype_request=p.dtype_request,
        index=index,
    )
    if p.expert_modules:
        units = tuple(_on_moe_mesh(u, p.expert_modules) for u in units)
    return p.replace(units=units, verified=vouch(index, units))


def _on_moe_mesh(unit: Unit, experts: tuple[str, ...]) -> Unit:
    """Units inside an expert module shard over the MoE mesh."""
    inside = [e for e in experts if all(m == e or m.startswith(e + ".") for m in unit.modules)]
    if not inside:
        return unit
    kind = "expert" if unit.modules == (inside[0],) else unit.kind
    return dataclasses.replace(unit, mesh="moe", kind=kind)


def sharding_transform(
    request: Callable[Concatenate[nn.Module, Plan, _P], Plan],
) -> Callable[Concatenate[nn.Module, Plan, _P], Plan]:
    """Make the transform from its request function, so each sharding
    transform's signature and docs are written once, on the request.

    The request ``(model, plan, /, **options) -> Plan`` records what to
    shard and resolves nothing; it is what ``compose`` runs for a fused run
    of sharding transforms (declared with :func:`request_transform`), which
    then resolves the units once. Called on its own, the transform records
    the request and resolves the units at once, with one model walk shared
    by both (a request that changes nothing returns the Plan as it was)."""

    @functools.wraps(request)
    def transform(model: nn.Module, plan: Plan, /, *args: _P.args, **kwargs: _P.kwargs) -> Plan:
        index = model_index(model, plan)
        scoped = plan if plan.scratch is index else plan.replace(scratch=index)
        requested = request(model, scoped, *args, **kwargs)
        if requested is scoped:
            return plan
        return _resolve(model, requested, index).replace(scratch=plan.scratch)

    return request_transform(request)(transform)


def check_reshard(value: object, where: str) -> bool | int | None:
    """``reshard_after_forward`` must be None, a bool, or a world size >= 1;
    caught here so a typo fails at planning, not inside the primitive after
    earlier units were already sharded."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise PlanningError(
        f"{where}: reshard_after_forward must be None, True, False or a positive int world size, "
        f"got {value!r}"
    )


def block_fqns(blocks: Names | None, index: ModelIndex, where: str) -> tuple[str, ...]:
    """The target blocks: given (module FQNs, class names or globs: see
    :func:`~fsdptx.plan._resolve.resolve_blocks`), or discovered; never
    nested in one another (a block inside another would be silently
    absorbed by it)."""
    if blocks is None:
        return index.blocks
    targets = resolve_blocks(name_tokens(blocks, "blocks", where), index, where)
    ordered = sorted(targets)
    for outer, inner in zip(ordered, ordered[1:]):
        if inner == outer or inner.startswith(outer + ".") or outer == "":
            raise PlanningError(
                f"{where}: blocks {outer or '<root>'!r} and {inner!r} overlap; list blocks that do not "
                "contain one another (the root is always planned last on its own)"
            )
    return targets


@sharding_transform
def shard_by_dtype(
    model: nn.Module,
    plan: Plan,
    /,
    *,
    blocks: Names | None = None,
    fp32_compute_module_names: Names | None = None,
    ignored_params: Names = (),
    reshard_after_forward: bool | int | None = None,
    expert_modules: Names | None = None,
) -> Plan:
    """Plan dtype-uniform FSDP units for every block, then the root.

    The root comes last and owns what no block unit owns (embeddings, final
    norm, head), so after apply every parameter belongs to exactly one unit.
    Each target follows the 1 / 2 / 3+ (storage, compute) group rule of
    :func:`fsdptx.fully_shard_by_dtype`.

    Defaults come from the model: ``blocks`` from ``_no_split_modules`` (or the
    largest ``nn.ModuleList``), pinned fp32 name tokens from
    ``_keep_in_fp32_modules_strict`` (and, when the policy computes in fp16,
    ``_keep_in_fp32_modules``: Hugging Face's rule). ``ignored_params`` are parameter FQNs no
    unit may own (another parallelism owns them). ``reshard_after_forward``
    falls back to the Plan's default. ``expert_modules`` (globs; default
    ``_fsdptx_expert_modules``) are planned first, each on the MoE mesh, and
    excluded from TP-replica sync.

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        blocks: class names, FQNs or globs of the blocks; discovered when
            ``None``.
        fp32_compute_module_names: name tokens that compute in fp32 (a
            bare string is one token); from the model when ``None``.
        ignored_params: parameter FQNs no unit may own.
        reshard_after_forward: every unit's reshard setting; the Plan's
            default when ``None``.
        expert_modules: globs of expert modules (one dotted segment per
            ``*``); from the model when ``None``.

    Returns:
        A new Plan with the dtype request recorded and the units resolved.

    Raises:
        PlanningError: the plan already holds a dtype request, a module is
            already ``fully_shard``-ed, blocks overlap, a glob matches nothing,
            or parameters that mix dtypes sit directly on one module.
        TypeError: a name argument holds something other than strings.

    Example::

        by_dtype = functools.partial(fsdptx.shard_by_dtype, fp32_compute_module_names=["sinks"])
        p = fsdptx.plan(model, by_dtype, mp_policy=policy)
    """
    index = model_index(model, plan)
    _refuse_presharded(index, "shard_by_dtype")
    if plan.dtype_request is not None:
        raise PlanningError(
            "shard_by_dtype: the plan already has a dtype request; pass every block to one "
            "shard_by_dtype (blocks=[...]) instead of composing it twice"
        )
    targets = block_fqns(blocks, index, "shard_by_dtype")
    tokens = (
        name_tokens(fp32_compute_module_names, "fp32_compute_module_names", "shard_by_dtype")
        if fp32_compute_module_names is not None
        else hf_fp32_compute_tokens(model, plan.mp_policy.param_dtype if plan.mp_policy else None)
    )
    experts = _experts(model, index, expert_modules)
    request = DtypeRequest(
        targets=experts + tuple(t for t in targets if t) + ("",),
        fp32_compute_module_names=tokens,
        ignored_params=name_tokens(ignored_params, "ignored_params", "shard_by_dtype"),
        reshard_after_forward=check_reshard(
            reshard_after_forward if reshard_after_forward is not None else plan.reshard_after_forward,
            "shard_by_dtype",
        ),
    )
    exclusions = plan.exclusions + tuple(e for e in experts if e not in plan.exclusions)
    warnings = plan.warnings
    if not targets:
        found_none = (
            f"found no blocks in {type(model).__name__} (no _no_split_modules, no nn.ModuleList or "
            "nn.ModuleDict of same-class children): the whole model is ONE FSDP unit (the root); name "
            "the blocks with FSDP2Config(blocks=...) or shard_by_dtype(blocks=...)"
        )
        warnings = warnings + (found_none,) if found_none not in warnings else warnings
    return plan.replace(dtype_request=request, expert_modules=experts, exclusions=exclusions, warnings=warnings)


def _refuse_presharded(index: ModelIndex, where: str) -> None:
    """A module the caller already ``fully_shard``-ed is refused, by name.

    Planning around it looks fine and breaks at the first forward: its unit
    was made with a policy the plan cannot see (``fully_shard``'s default
    computes in fp32), so it hands fp32 activations to the plan's bf16
    units (``expected m1 and m2 to have the same dtype``). The transforms
    plan every unit of a model; the seed-compatible imperative API
    (``fully_shard_by_dtype`` block by block, then the root) is the way to
    shard a model piecewise."""
    if not index.sharded:
        return
    found = [f or "<root>" for f, m in zip(index.module_fqns, index.walk.modules) if id(m) in index.sharded]
    raise PlanningError(
        f"{where}: {preview(found)} {'is' if len(found) == 1 else 'are'} already FSDP-sharded (fully_shard was "
        "called on it); the plan cannot know its policy and would break at the first forward. Plan and apply "
        "a model that fully_shard has not touched, or shard piecewise with fsdptx.fully_shard_by_dtype"
    )


def _experts(model: nn.Module, index: ModelIndex, globs: Names | None) -> tuple[str, ...]:
    """Expert module FQNs from globs (one dotted segment per ``*``), or the
    model's ``_fsdptx_expert_modules``; planned before their blocks, so each
    is a unit of its own on the MoE mesh, and kept out of TP-replica sync
    (expert shards differ between ranks by design)."""
    patterns = (
        name_tokens(globs, "expert_modules", "shard_by_dtype")
        if globs is not None
        else name_tokens(getattr(model, "_fsdptx_expert_modules", None), "_fsdptx_expert_modules")
    )
    found: list[str] = []
    for g in patterns:
        matched = index.match(g)
        if not matched:
            raise PlanningError(f"shard_by_dtype: expert module glob {g!r} matches no module of the model")
        found.extend(f for f in matched if f not in found)
    return tuple(sorted(found, key=natural_key))


@sharding_transform
def shard_across_blocks(
    model: nn.Module,
    plan: Plan,
    /,
    *,
    blocks: Names | None = None,
    module_names: Names | None = None,
) -> Plan:
    """Plan one FSDP unit per name, spanning every block's instance of it.

    Defaults: ``blocks`` as in :func:`shard_by_dtype`, ``module_names`` from the
    model's ``_fsdp_shard_across_blocks``. A model that declares no names gets
    the Plan back unchanged, so the transform is safe in a generic pipeline.

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        blocks: class names, FQNs or globs of the blocks; discovered when
            ``None``.
        module_names: block-relative names of the fp32 holders (``"sinks"``,
            or ``"self_attn"`` for the sinks it owns directly); a bare string
            is one name; from ``_fsdp_shard_across_blocks`` when ``None``.

    Returns:
        A new Plan with one cross-block unit per name (the same Plan when no
        names are given or declared).

    Raises:
        PlanningError: no blocks were found, a name is in no block, or a
            module is already ``fully_shard``-ed.

    Example::

        holders = functools.partial(fsdptx.shard_across_blocks, module_names=["attn.sinks"])
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, holders))
    """
    names = (
        name_tokens(module_names, "module_names", "shard_across_blocks")
        if module_names is not None
        else name_tokens(getattr(model, "_fsdp_shard_across_blocks", None), "_fsdp_shard_across_blocks")
    )
    if not names:
        return plan
    index = model_index(model, plan)
    _refuse_presharded(index, "shard_across_blocks")
    targets = block_fqns(blocks, index, "shard_across_blocks")
    if not targets:
        raise PlanningError(
            f"shard_across_blocks: found no blocks in {type(model).__name__} for {list(names)}; "
            "declare _no_split_modules or pass blocks="
        )
    request = CrossBlockRequest(blocks=targets, names=names)
    return plan.replace(cross_block_requests=plan.cross_block_requests + (request,))




def _matching(index: ModelIndex, patterns: Collection[str]) -> dict[str, list[str]]:
    """Module FQNs matched by each glob, in one pass over the modules: a
    combined regex rejects the (usual) non-matching FQN in one call."""
    out: dict[str, list[str]] = {g: [] for g in patterns}
    if not patterns:
        return out
    compiled = [(g, re.compile(fnmatch.translate(g))) for g in patterns]
    any_glob = re.compile("|".join(f"(?:{fnmatch.translate(g)})" for g in patterns))
    for fqn in index.modules:
        if any_glob.match(fqn):
            for g, rx in compiled:
                if rx.match(fqn):
                    out[g].append(fqn)
    return out




def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _declared_reductions(model: nn.Module, index: ModelIndex) -> dict[str, str]:
    """``_tp_replica_reductions`` plus what Hugging Face's TP plan implies
    (``replicated_with_grad_allreduce`` -> ``sum``); HF entries for layers a
    config did not build are dropped, not errors."""
    own = getattr(model, "_tp_replica_reductions", None) or {}
    if not isinstance(own, Mapping):
        raise TypeError(f"{type(model).__name__}._tp_replica_reductions must be a mapping of module glob -> reduction")
    implied = {g: r for g, r in hf_replica_reductions(model).items() if _matching(index, [g])[g]}
    return {**implied, **own}


@unit_blind
def mark_reduction(
    model: nn.Module,
    plan: Plan,
    /,
    *,
    reductions: Mapping[str, str] | None = None,
    exclude: Names | None = None,
) -> Plan:
    """Record TP-replica gradient reductions and exclusions in the Plan.

    ``reductions`` maps a module-FQN glob to ``"mean"`` (replicas computed the
    same thing redundantly) or ``"sum"`` (replicas hold disjoint partial
    contributions); it marks the matched modules' direct parameters.
    ``exclude`` globs name subtrees that stay rank-local. Defaults come from
    ``_tp_replica_reductions`` and ``_tp_replica_sync_exclude``, plus the
    ``sum`` that a Hugging Face TP plan's ``replicated_with_grad_allreduce``
    implies. A glob that
    matches nothing is an error: it is almost always a typo that would
    otherwise silently leave gradients unsynchronized.

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        reductions: module-FQN glob -> ``"mean"`` or ``"sum"``; from the model
            when ``None``.
        exclude: module-FQN globs of subtrees kept out of TP-replica sync (a
            bare string is one glob); from the model when ``None``.

    Returns:
        A new Plan with the marks and exclusions recorded.

    Raises:
        TypeError: ``reductions`` is not a mapping.
        ValueError: a reduction is neither ``"mean"`` nor ``"sum"``.
        PlanningError: a glob matches no module (or no module owning a
            parameter), or one parameter gets both reductions.

    Example::

        marks = functools.partial(fsdptx.mark_reduction, reductions={"layers.*.router": "sum"})
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, marks))
    """
    require_module(model, "model", "mark_reduction")
    if reductions is not None and not isinstance(reductions, Mapping):
        raise TypeError(
            f"mark_reduction: reductions must be a mapping of module glob -> 'mean' or 'sum' "
            f"(e.g. {{'layers.*.router': 'sum'}}), got {type(reductions).__name__} {reductions!r}"
        )
    index = model_index(model, plan)
    marks = dict(reductions) if reductions is not None else _declared_reductions(model, index)
    globs = name_tokens(
        exclude if exclude is not None else getattr(model, "_tp_replica_sync_exclude", None), "exclude", "mark_reduction"
    )
    valid: dict[str, Reduction] = {g: r for g, r in marks.items() if is_reduction(r)}
    bad = {g: r for g, r in marks.items() if g not in valid}
    if bad:
        raise ValueError(
            "mark_reduction: unknown reduction "
            + ", ".join(f"{r!r} for {g!r}" for g, r in bad.items())
            + f"; use one of {REDUCTIONS}"
        )
    matches = _matching(index, [*marks, *globs])
    out: dict[str, Reduction] = dict(plan.reductions)
    source: dict[str, str] = {}
    for pattern, reduction in valid.items():
        matched = matches[pattern]
        if not matched:
            raise PlanningError(f"mark_reduction: reduction glob {pattern!r} matches no module of the model")
        direct = [index.direct_param_fqns(fqn) for fqn in matched]
        if not any(direct):
            raise PlanningError(
                f"mark_reduction: reduction glob {pattern!r} matches {preview(matched)}, none of which holds "
                "a parameter directly (a mark applies to a module's own parameters); point it at the "
                "modules that own them, e.g. " + repr(pattern + ".*")
            )
        for names in direct:
            for pfqn in names:
                if out.get(pfqn, reduction) != reduction:
                    raise PlanningError(
                        f"mark_reduction: parameter {pfqn!r} is marked both {out[pfqn]!r}"
                        f" (by {source.get(pfqn, 'an earlier mark')!r}) and {reduction!r} (by {pattern!r})"
                    )
                out[pfqn] = reduction
                source[pfqn] = pattern
    excluded = list(plan.exclusions)
    for pattern in globs:
        matched = matches[pattern]
        if not matched:
            raise PlanningError(f"mark_reduction: exclusion glob {pattern!r} matches no module of the model")
        if not any(_holds_tensors(index.modules[f]) for f in matched):
            raise PlanningError(
                f"mark_reduction: exclusion glob {pattern!r} matches {preview(matched)}, whose subtrees hold "
                "no parameter or buffer; nothing would stay rank-local"
            )
        excluded.extend(f for f in matched if f not in excluded)
    return plan.replace(reductions=out, exclusions=tuple(excluded))
