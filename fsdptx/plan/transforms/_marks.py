"""The TP-replica marks transform: :func:`mark_reduction`.

It records which parameters' gradients TP replicas reduce (``mean`` or
``sum``) and which subtrees stay rank-local, from the arguments or from what
the model (and its Hugging Face TP plan) declares. It resolves no unit, so
``compose`` does not interrupt a run of sharding transforms for it.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Mapping
from itertools import compress, repeat

from torch import nn

from ...core._names import Names, name_tokens
from ...hf import hf_replica_reductions
from ...model._stages import STAGE_ATTRIBUTE
from ...model._index import ModelIndex, PlanningError, empty_containers_note
from .._compose import check_transform_args, model_index
from .._kinds import unit_blind
from .._plan import Plan
from .._types import REDUCTIONS, Reduction, is_reduction, preview

__all__ = ["mark_reduction"]


def _matching(index: ModelIndex, patterns: Collection[str]) -> dict[str, list[str]]:
    """Module FQNs matched by each glob, in index order. A glob without a
    wildcard is looked up; any other glob's literal tail and head (after
    its last wildcard, before its first) filter the FQNs first, at C
    level, and only those left are matched against the glob: a model has
    thousands of modules and a glob matches a few of them."""
    out: dict[str, list[str]] = {}
    fqns = index.module_fqns
    for glob in patterns:
        if not _WILDCARDS.intersection(glob):
            out[glob] = [glob] if glob in index.modules else []
            continue
        head, tail = _literal_ends(glob)
        candidates = fqns
        if tail:
            candidates = list(compress(candidates, map(str.endswith, candidates, repeat(tail))))
        if head:
            candidates = list(compress(candidates, map(str.startswith, candidates, repeat(head))))
        out[glob] = list(filter(re.compile(fnmatch.translate(glob)).match, candidates))
    gaps = index.stage_gaps  # a pipeline stage's stand-ins for other stages' parts match nothing
    return {g: [f for f in fs if f not in gaps] for g, fs in out.items()} if gaps else out


_WILDCARDS = frozenset("*?[")


def _literal_ends(glob: str) -> tuple[str, str]:
    """What every match of ``glob`` starts and ends with: the text before
    its first wildcard character and after its last (``]`` counted as one,
    so a literal ``]`` only shortens the tail)."""
    first = min((i for i in map(glob.find, "*?[") if i >= 0), default=len(glob))
    last = max(map(glob.rfind, "*?]"))
    return glob[:first], glob[last + 1 :]


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
    check_transform_args(model, plan, "mark_reduction")
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
    if getattr(model, STAGE_ATTRIBUTE, None) is not None:
        # A pipeline stage: marks are written for the whole model, so a glob
        # naming only what other stages hold (absent here, or a gap, which
        # matches nothing) is theirs, not a mistake.
        skipped = {g for g, fs in matches.items() if not fs}
        valid = {g: r for g, r in valid.items() if g not in skipped}
        globs = tuple(g for g in globs if g not in skipped)
    out: dict[str, Reduction] = dict(plan.reductions)
    source: dict[str, str] = {}
    for pattern, reduction in valid.items():
        matched = matches[pattern]
        if not matched:
            raise PlanningError(
                f"mark_reduction: reduction glob {pattern!r} matches no module of the model{empty_containers_note(index)}"
            )
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
            raise PlanningError(
                f"mark_reduction: exclusion glob {pattern!r} matches no module of the model{empty_containers_note(index)}"
            )
        if not any(_holds_tensors(index.modules[f]) for f in matched):
            raise PlanningError(
                f"mark_reduction: exclusion glob {pattern!r} matches {preview(matched)}, whose subtrees hold "
                "no parameter or buffer; nothing would stay rank-local"
            )
        excluded.extend(f for f in matched if f not in excluded)
    return plan.replace(reductions=out, exclusions=tuple(excluded))
