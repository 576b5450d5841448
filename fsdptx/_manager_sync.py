"""``gradient_sync_context``: deferring FSDP2's gradient reduction across
micro-batches.

A module of its own because it reads no config and no mesh, only the FSDP
state of a model already sharded: it works on any FSDP2 model, not only
one the manager built. :mod:`fsdptx.manager` re-exports it, and
:meth:`fsdptx.FSDP2Manager.gradient_sync_context` calls it through that
module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from .core._args import require_module
from .core._torch_internals import fsdp_is_root, fsdp_param_groups, fsdp_state

__all__ = ["gradient_sync_context"]


@contextlib.contextmanager
def gradient_sync_context(model: nn.Module, is_optimizer_step: bool, *, defer: bool = True) -> Iterator[None]:
    """Run one micro-batch's backward inside this context.

    With ``defer``, FSDP reduce-scatters gradients only on the micro-batch
    that ends the optimizer step (``is_optimizer_step=True``); the others
    accumulate unsharded gradients locally, so N micro-batches cost one
    reduce-scatter per unit instead of N. Without ``defer`` every micro-batch
    reduces (less memory, more communication). A model with no FSDP unit is
    left alone.

    On exit every unit gets back the sync setting it had on entry (not
    "on"): nested contexts then compose, and a unit whose sync the user had
    turned off stays off. Arguments are checked before any unit changes.

    ``model`` must be the whole model: a block (or the list of blocks) of a
    larger FSDP model is refused, since deferring it alone would leave the
    units outside it reducing on every micro-batch. FSDP knows which unit
    is the root only from the first forward on, so a part given to the
    first context is refused when that context exits, and on entry after.

    Args:
        model: the (partly) FSDP-sharded model.
        is_optimizer_step: whether this micro-batch ends the optimizer step.
        defer: whether to skip the reduce-scatter on the other micro-batches.

    Yields:
        Nothing; the backward runs inside.

    Raises:
        TypeError: ``is_optimizer_step`` or ``defer`` is not a bool.
        RuntimeError: ``model`` is part of a larger FSDP model.

    Example::

        for i, batch in enumerate(micro_batches):
            with fsdptx.gradient_sync_context(model, is_optimizer_step=i == len(micro_batches) - 1):
                model(batch).sum().backward()
    """
    require_module(model, "model", "gradient_sync_context")
    if not isinstance(is_optimizer_step, bool):
        raise TypeError(
            f"gradient_sync_context: is_optimizer_step must be a bool (True on the micro-batch that ends "
            f"the optimizer step), got {type(is_optimizer_step).__name__} {is_optimizer_step!r}"
        )
    if not isinstance(defer, bool):
        raise TypeError(f"gradient_sync_context: defer must be a bool, got {type(defer).__name__} {defer!r}")
    states = _fsdp_states(model)
    _refuse_a_part(model, states)
    groups = [g for state in states for g in fsdp_param_groups(state)]
    if not defer or not groups:
        yield
        return
    saved = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
    for g in groups:
        g.reduce_grads = is_optimizer_step
        g.all_reduce_grads = is_optimizer_step
    try:
        yield
    finally:
        for g, reduce_grads, all_reduce_grads in saved:
            g.reduce_grads = reduce_grads
            g.all_reduce_grads = all_reduce_grads
    # The first forward is where FSDP decides which unit is the root: a
    # part of a larger model is only known as one after it (see _refuse_a_part).
    _refuse_a_part(model, states)


def _refuse_a_part(model: nn.Module, states: list[Any]) -> None:
    """Refuse a ``model`` that is part of a larger FSDP model (a block, or a
    container of blocks, whose root unit is outside it): deferring it alone
    would leave every unit outside it reduce-scattering on each micro-batch.
    FSDP marks every unit under the root as not the root at the first
    forward, so a part is known from then on; before it, a part cannot be
    told from a whole model, and the check after the first context's body
    catches it (its backward ran, and is correct, only not deferred for the
    units outside)."""
    if states and all(fsdp_is_root(s) is False for s in states):
        raise RuntimeError(
            f"gradient_sync_context: model ({type(model).__name__}) is part of a larger FSDP model: its "
            "units' root is outside it, so deferring it alone would leave the rest of the model "
            "reduce-scattering on every micro-batch; pass the whole model (what parallelize returned)"
        )


def _fsdp_states(model: nn.Module) -> list[Any]:
    """Each FSDP state under ``model`` once (a unit spanning several modules
    shares one), in module order. Its parameter groups are where FSDP2
    keeps the flags ``set_requires_gradient_sync`` sets, ``reduce_grads``
    and ``all_reduce_grads``, so they can be read back and restored."""
    seen: set[int] = set()
    states: list[Any] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = fsdp_state(m)
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states

