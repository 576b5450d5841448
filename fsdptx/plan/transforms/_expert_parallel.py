"""The ``expert_parallel`` transform: plan experts split by expert across ``ep``.

A MoE layer keeps its experts stacked on dim 0 of each weight
(``[num_experts, ...]``). Under expert parallelism each rank of the MoE
mesh's ``ep`` dim holds ``num_experts / ep`` whole experts, and FSDP shards
those over the remaining data-parallel dims. The planning half is pure:
it finds each expert module's parameters and their common expert count,
and refuses what cannot be split by expert. How many ranks ``ep`` has is a
fact of the mesh: given as ``ep=`` (``FSDP2Manager`` passes its MoE mesh's),
an expert count it does not divide is refused here, at planning, as
:func:`fsdptx.apply_plan` would refuse it (both read
:func:`uneven_experts`).
"""

from __future__ import annotations

from collections.abc import Collection

from torch import nn

from ...hf._expert_parallel import hf_dispatches_experts
from ...model._index import STAGE_MODEL_ATTRIBUTE, ModelNames, PlanningError
from .._compose import check_transform_args, model_index
from .._kinds import unit_blind
from .._plan import Plan
from .._types import ExpertParallel, preview
from ._shard import _experts

__all__ = ["EP_HOOK", "expert_parallel", "uneven_experts"]

EP_HOOK = "set_expert_parallel_mesh"
"""The method an expert module defines to learn its ``ep`` mesh: its forward
then sends each token to the ``ep`` rank holding the token's expert (an
all-to-all over ``ep_mesh.get_group()``) and runs only its local experts."""


def uneven_experts(ep: ExpertParallel, size: int) -> str | None:
    """The problem, if any, of splitting ``ep``'s expert modules across an
    ``ep`` dim of ``size`` ranks: each rank must hold whole experts, so
    every expert count must divide by ``size``."""
    uneven = [f"{m} ({n} experts)" for m, n in zip(ep.modules, ep.num_experts) if n % size]
    if not uneven:
        return None
    return (
        f"expert modules {preview(uneven)} cannot be split evenly across ep={size}; use an ep size that "
        "divides the expert count"
    )


@unit_blind
def expert_parallel(
    model: nn.Module, plan: Plan, /, *, expert_modules: Collection[str] | None = None, ep: int | None = None
) -> Plan:
    """Plan expert parallelism: every parameter of each expert module is
    split on dim 0 (its expert dim) across the MoE mesh's ``ep`` dim.

    Sending tokens to the rank that holds their expert is the model's
    business: :func:`fsdptx.apply_plan` hands each expert module its ``ep``
    mesh through :data:`EP_HOOK` (a transformers experts module gets
    transformers' own dispatch installed instead) and refuses, before
    changing anything, a module it cannot tell (its forward would run only
    the local experts on every token: a wrong result, silently). FSDP shards the experts over
    the MoE mesh's data-parallel dims (HSDP where one replicates).

    Args:
        model: the model (only read).
        plan: the plan so far.
        expert_modules: globs of the expert modules; default the plan's
            (``shard_by_dtype(expert_modules=...)``), else the model's
            ``_fsdptx_expert_modules``.
        ep: the size of the MoE mesh's ``ep`` dim the plan is for, when
            known (``FSDP2Manager`` passes it): checked against every
            expert count here. ``None``: checked by ``apply_plan`` only.

    Returns:
        ``plan`` with :attr:`Plan.expert_parallel` set (a warning added for
        expert modules that neither define :data:`EP_HOOK` nor are
        transformers experts).

    Raises:
        PlanningError: no expert modules; an expert module without
            parameters, with a scalar one, or whose parameters disagree on
            dim 0 (the expert count), naming them; an expert count ``ep``
            does not divide.
        TypeError, ValueError: ``ep`` is not a positive int.

    Example::

        # experts from the model's _fsdptx_expert_modules; moe_mesh has an "ep" dim
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.expert_parallel))
        fsdptx.apply_plan(p, model, mesh, moe_mesh=moe_mesh)
    """
    check_transform_args(model, plan, "expert_parallel")
    if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int)):
        raise TypeError(f"expert_parallel: ep must be an int (the MoE mesh's ep dim size) or None, got {ep!r}")
    if ep is not None and ep < 1:
        raise ValueError(f"expert_parallel: ep must be >= 1, got {ep}")
    index = model_index(model, plan)
    modules = _experts(model, index, expert_modules, "expert_parallel") if expert_modules is not None else plan.expert_modules
    if not modules:
        modules = _experts(model, index, None, "expert_parallel")
    if not modules and isinstance(getattr(index.root, STAGE_MODEL_ATTRIBUTE, None), ModelNames):
        return plan  # a pipeline stage whose blocks have no experts: other stages split theirs
    if not modules:
        raise PlanningError(
            "expert_parallel: no expert modules: pass expert_modules=[globs], plan shard_by_dtype(expert_modules=...) "
            "first, or declare _fsdptx_expert_modules on the model"
        )
    counts: list[int] = []
    params: list[str] = []
    problems: list[str] = []
    for fqn in modules:
        named = [(f"{fqn}.{n}" if fqn else n, p) for n, p in index.modules[fqn].named_parameters()]
        if not named:
            problems.append(f"expert module {fqn!r} has no parameters to split by expert")
            continue
        leading = {name: (p.shape[0] if p.dim() else None) for name, p in named}
        sizes = set(leading.values())
        if len(sizes) != 1 or None in sizes:
            shown = ", ".join(f"{n}: {s if s is not None else 'scalar'}" for n, s in leading.items())
            problems.append(
                f"expert module {fqn!r}: its parameters must all keep the experts on dim 0 with one expert count, "
                f"but dim 0 is {shown}; name only the stacked-experts modules as expert modules"
            )
            continue
        counts.append(sizes.pop())  # type: ignore[arg-type]
        params.extend(name for name, _ in named)
    if problems:
        raise PlanningError("expert_parallel: " + "; ".join(problems))
    hookless = [
        f
        for f in modules
        if not (callable(getattr(index.modules[f], EP_HOOK, None)) or hf_dispatches_experts(index.modules[f]))
    ]
    warnings = plan.warnings
    if hookless:
        warning = (
            f"expert modules {preview(hookless)} define no {EP_HOOK}(ep_mesh) and are not transformers experts: "
            "apply_plan refuses them, since their forward would run only the local experts; give the experts "
            "module that method and dispatch tokens over the ep group in its forward"
        )
        warnings = warnings + (warning,) if warning not in warnings else warnings
    split = ExpertParallel(modules=tuple(modules), num_experts=tuple(counts), params=tuple(params))
    uneven = uneven_experts(split, ep) if ep is not None else None
    if uneven is not None:
        raise PlanningError(f"expert_parallel: {uneven}")
    return plan.replace(expert_parallel=split, warnings=warnings)
