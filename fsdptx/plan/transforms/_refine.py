"""Transforms that record activation checkpointing, or refine resolved units
(reshard after forward, explicit prefetch chains, unused-parameter
reduction). Each is pure: it reads the model and the Plan and returns a new
Plan; ``apply_plan`` carries the result out."""

from __future__ import annotations

import dataclasses
from typing import get_args

from torch import nn

from ...core._args import require_bool
from ...core._names import Names
from ...model._index import PlanningError, empty_containers_note, kv_cache_switches
from .._compose import check_transform_args, model_index
from .._kinds import unit_blind
from .._plan import Plan
from .._types import Checkpointing, CheckpointMode, Prefetch, Unit
from ._shard import block_fqns

__all__ = [
    "block_units",
    "checkpoint_activations",
    "prefetch",
    "reduce_unused_params",
    "reshard_policy",
]

CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)


@unit_blind
def checkpoint_activations(
    model: nn.Module,
    plan: Plan,
    /,
    *,
    mode: CheckpointMode = "full",
    blocks: Names | None = None,
) -> Plan:
    """Checkpoint activations of each block: ``"full"`` keeps only each
    block's input and recomputes the rest in backward; ``"selective"`` also
    keeps the outputs of matrix multiplications and attention (the costly
    ops) and recomputes only the cheap elementwise ones and norms.

    Applied with torch's composable ``checkpoint`` (hooks, no wrapper
    module), so parameter FQNs and ``state_dict()`` keys are unchanged. A
    KV cache cannot be replayed in backward: the Plan lists the model's
    ``use_cache`` switches that are on (applying turns them off).
    Blocks default to the model's (``_no_split_modules`` or the largest
    ``nn.ModuleList``).

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        mode: ``"full"`` or ``"selective"``.
        blocks: class names, FQNs or globs of the blocks; discovered when
            ``None``.

    Returns:
        A new Plan recording the checkpointing request.

    Raises:
        PlanningError: an unknown mode, or no blocks found.

    Example::

        ac = functools.partial(fsdptx.checkpoint_activations, mode="selective")
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, ac))
    """
    check_transform_args(model, plan, "checkpoint_activations")
    if mode not in CHECKPOINT_MODES:
        raise PlanningError(f"checkpoint_activations: unknown mode {mode!r}; use one of {CHECKPOINT_MODES}")
    index = model_index(model, plan)
    targets = block_fqns(blocks, index, "checkpoint_activations")
    if not targets:
        raise PlanningError(
            f"checkpoint_activations: found no blocks in {type(model).__name__} to checkpoint"
            f"{empty_containers_note(index)}; name them "
            "with FSDP2Config(blocks=...) or checkpoint_activations(blocks=...), or declare _no_split_modules"
        )
    kv = kv_cache_switches(index.modules.items())
    return plan.replace(checkpointing=Checkpointing(mode=mode, modules=targets, kv_cache_off=kv))


def block_units(plan: Plan) -> list[tuple[int, Unit]]:
    """The units that are blocks of the dtype request (not experts), in
    block order, with their index in ``plan.units``."""
    request = plan.dtype_request
    if request is None:
        return []
    experts = set(plan.expert_modules)
    order = {fqn: i for i, fqn in enumerate(t for t in request.targets if t and t not in experts)}
    found = [(i, u) for i, u in enumerate(plan.units) if u.kind == "block" and u.modules[0] in order]
    return sorted(found, key=lambda item: order[item[1].modules[0]])


def _inside(fqn: str, block: str) -> bool:
    return fqn == block or fqn.startswith(block + ".")


def reshard_policy(model: nn.Module, plan: Plan, /, *, pipeline_parallel: bool = False) -> Plan:
    """Resolve ``reshard_after_forward`` for every unit left at the default.

    Blocks reshard after forward (their parameters are freed until backward
    needs them), except the last block, whose backward starts right after
    forward, so freeing it would only cost an all-gather. The root never
    reshards for the same reason. With pipeline parallelism nothing
    reshards: a stage runs several micro-batches' forwards before their
    backwards, and would re-gather each time. An explicit value, given to
    ``plan()`` or ``shard_by_dtype``, wins.

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        pipeline_parallel: whether the model is a pipeline stage (nothing
            reshards).

    Returns:
        A new Plan whose units all have an explicit ``reshard_after_forward``.

    Example::

        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.reshard_policy))
        assert p.units[-1].reshard_after_forward is False  # the root
    """
    check_transform_args(model, plan, "reshard_policy")
    require_bool(pipeline_parallel, "pipeline_parallel", "reshard_policy")
    blocks = block_units(plan)
    last = blocks[-1][1].modules[0] if blocks else None
    units = []
    for u in plan.units:
        if u.reshard_after_forward is not None:
            units.append(u)
            continue
        if pipeline_parallel or u.modules == ("",):
            value = False
        else:
            value = not (last is not None and all(_inside(m, last) for m in u.modules))
        units.append(dataclasses.replace(u, reshard_after_forward=value))
    return plan.replace(units=tuple(units))


def prefetch(model: nn.Module, plan: Plan, /, *, forward_depth: int = 1, backward_depth: int = 2) -> Plan:
    """Explicit prefetch chains between consecutive block units.

    In forward, block ``i`` starts all-gathering blocks ``i+1 .. i+forward_depth``
    while it computes; in backward, blocks ``i-1 .. i-backward_depth``. FSDP2's
    implicit prefetch looks one unit ahead at most, and only in backward, so
    deeper chains hide more all-gather latency behind compute, at the cost of
    holding that many more blocks unsharded. Nothing is chained when no block
    unit reshards after forward (its parameters are never freed, so there is
    nothing to fetch ahead).

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).
        forward_depth: how many block units forward all-gathers ahead.
        backward_depth: how many block units backward all-gathers ahead.

    Returns:
        A new Plan with the prefetch chains (none when nothing reshards).

    Raises:
        PlanningError: a depth is not a non-negative int.

    Example::

        deeper = functools.partial(fsdptx.prefetch, forward_depth=2)
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.reshard_policy, deeper))
    """
    check_transform_args(model, plan, "prefetch")
    for name, depth in (("forward_depth", forward_depth), ("backward_depth", backward_depth)):
        if type(depth) is not int or depth < 0:
            raise PlanningError(f"prefetch: {name} must be a non-negative int, got {depth!r}")
    units = [u for _i, u in block_units(plan)]
    blocks = [u.modules[0] for u in units]
    resharded = any(u.reshard_after_forward is not False for u in units)
    if not blocks or not resharded or (forward_depth == 0 and backward_depth == 0):
        return plan.replace(prefetch=())
    chains = tuple(
        Prefetch(
            unit=b,
            forward=tuple(blocks[i + 1 : i + 1 + forward_depth]),
            backward=tuple(reversed(blocks[max(0, i - backward_depth) : i])),
        )
        for i, b in enumerate(blocks)
    )
    return plan.replace(prefetch=tuple(c for c in chains if c.forward or c.backward))


def reduce_unused_params(model: nn.Module, plan: Plan, /) -> Plan:
    """Every unit reduce-scatters zeros for parameters a rank did not use.

    Needed with context parallelism (packed or modality-dependent batches):
    a rank whose gradient is ``None`` would otherwise skip a reduce-scatter
    its peers enter, and the job hangs.

    Args:
        model: the model, only read.
        plan: the Plan so far (positional only: the transform protocol).

    Returns:
        A new Plan whose units reduce-scatter zeros for unused parameters.

    Example::

        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.reduce_unused_params))
    """
    check_transform_args(model, plan, "reduce_unused_params")
    return plan.replace(reduce_unused_params=True)
