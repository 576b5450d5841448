"""The sharding transforms: :func:`shard_by_dtype` and :func:`shard_across_blocks`.

Each is written once, as a request function that records what to shard in
the Plan; :func:`sharding_transform` makes it the transform that also
resolves the units (``compose`` runs the bare request for a fused run). Also
the helpers other transforms share: :func:`block_fqns` (the target blocks)
and :func:`_experts` (expert module FQNs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec

from torch import nn

from ...core._names import Names, name_tokens, natural_key
from ...hf import hf_fp32_compute_tokens
from ...model._index import (
    STAGE_MODEL_ATTRIBUTE,
    ModelIndex,
    ModelNames,
    PlanningError,
    empty_containers_note,
    resolve_blocks,
)
from .._compose import _resolve, check_reshard, check_transform_args, model_index
from .._kinds import request_transform
from .._plan import Plan
from .._types import CrossBlockRequest, DtypeRequest, preview

__all__ = ["block_fqns", "shard_across_blocks", "shard_by_dtype", "sharding_transform"]


_P = ParamSpec("_P")


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
        check_transform_args(model, plan, request.__name__)
        index = model_index(model, plan)
        scoped = plan if plan.scratch is index else plan.replace(scratch=index)
        requested = request(model, scoped, *args, **kwargs)
        if requested is scoped:
            return plan
        return _resolve(model, requested, index).replace(scratch=plan.scratch)

    return request_transform(request)(transform)


def block_fqns(blocks: Names | None, index: ModelIndex, where: str) -> tuple[str, ...]:
    """The target blocks: given (module FQNs, class names or globs: see
    :func:`~fsdptx.model._index.resolve_blocks`), or discovered; never
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
            f"nn.ModuleDict of same-class children){empty_containers_note(index)}: the whole model is ONE "
            "FSDP unit (the root); name "
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


def _experts(model: nn.Module, index: ModelIndex, globs: Names | None, where: str = "shard_by_dtype") -> tuple[str, ...]:
    """Expert module FQNs from globs (one dotted segment per ``*``), or the
    model's ``_fsdptx_expert_modules``; planned before their blocks, so each
    is a unit of its own on the MoE mesh, and kept out of TP-replica sync
    (expert shards differ between ranks by design)."""
    patterns = (
        name_tokens(globs, "expert_modules", where)
        if globs is not None
        else name_tokens(getattr(model, "_fsdptx_expert_modules", None), "_fsdptx_expert_modules")
    )
    found: list[str] = []
    whole = getattr(index.root, STAGE_MODEL_ATTRIBUTE, None)
    for g in patterns:
        matched = index.match(g)
        if not matched and isinstance(whole, ModelNames) and whole.matches(g):
            continue  # experts other pipeline stages hold (a dense-first stack's first stage)
        if not matched:
            raise PlanningError(f"{where}: expert module glob {g!r} matches no module of the model")
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
    if blocks is not None:
        name_tokens(blocks, "blocks", "shard_across_blocks")  # checked even when there is nothing to do
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
            f"shard_across_blocks: found no blocks in {type(model).__name__} for {list(names)}"
            f"{empty_containers_note(index)}; "
            "declare _no_split_modules or pass blocks="
        )
    request = CrossBlockRequest(blocks=targets, names=names)
    return plan.replace(cross_block_requests=plan.cross_block_requests + (request,))
