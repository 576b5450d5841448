"""Auditing the replicas every N optimizer steps: a step post-hook that
runs :func:`fsdptx.audit_replicas` on every rank at the same step.

Everything the audit would refuse is refused when the hook is registered,
not at the N-th step, hours into a job."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.hooks import RemovableHandle

from ._audit import ReplicaAudit, audit_replicas, check_arguments

__all__ = ["audit_replicas_every"]

ModelParts = Sequence[nn.Module] | nn.Module


def _check_audit_call(
    audit: Callable[..., ReplicaAudit], model_parts: object, device_mesh: object, audit_kwargs: dict[str, Any]
) -> None:
    """Refuse, at registration, a call the hook would make and fail on:
    keywords ``audit`` does not take, and (for :func:`audit_replicas`)
    every argument it checks. No collective runs here."""
    try:
        signature = inspect.signature(audit)
    except (TypeError, ValueError):  # a callable without a signature: its own call checks
        return
    try:
        bound = signature.bind(model_parts, device_mesh, **audit_kwargs)
    except TypeError as e:
        known = [n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        raise TypeError(f"audit_replicas_every: cannot call the audit with {sorted(audit_kwargs)} ({e}); its keywords are {known}") from None
    if audit is audit_replicas:
        bound.apply_defaults()
        a = bound.arguments
        check_arguments(
            a["model_parts"], a["device_mesh"], a["atol"], a["rtol"], a["buffers"], a["tp_axis_name"], "audit_replicas_every"
        )


def audit_replicas_every(
    optimizer: torch.optim.Optimizer,
    model_parts: ModelParts,
    device_mesh: DeviceMesh,
    every: int,
    *,
    on_drift: Callable[[ReplicaAudit], None] | None = None,
    audit: Callable[..., ReplicaAudit] = audit_replicas,
    **audit_kwargs: Any,
) -> RemovableHandle:
    """Audit the replicas after every ``every``-th ``optimizer.step()``.

    A step post-hook on ``optimizer``: it runs on every rank at the same
    step (each rank steps its optimizer once per update), so the audit's
    collectives line up. By default a drift raises ``AssertionError`` with
    the table (stop the job while the checkpoint before it is still good);
    ``on_drift`` receives the audit instead (log it, count it).

    Args:
        optimizer: the optimizer whose steps are counted.
        model_parts, device_mesh: as for :func:`audit_replicas`.
        every: audit every this many steps (>= 1).
        on_drift: called with a failed audit instead of raising.
        audit: the audit function (injectable for tests).
        **audit_kwargs: ``atol``, ``rtol``, ``buffers``, ``tp_axis_name``.

    Returns:
        The hook's handle; ``handle.remove()`` stops auditing.

    Raises:
        TypeError, ValueError: at registration, not at the N-th step: an
            argument the audit would refuse (the model parts, the mesh,
            ``atol``/``rtol``, ``buffers``, ``tp_axis_name``), a keyword
            ``audit`` does not take, ``every`` not a positive int,
            ``optimizer`` not an optimizer.

    Example::

        fsdptx.audit_replicas_every(opt, [model], mesh, every=100)
    """
    where = "audit_replicas_every"
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch Optimizer, got {type(optimizer).__name__}")
    if isinstance(every, bool) or not isinstance(every, int):
        raise TypeError(f"{where}: every must be an int, got {every!r}")
    if every < 1:
        raise ValueError(f"{where}: every must be >= 1, got {every}")
    if on_drift is not None and not callable(on_drift):
        raise TypeError(f"{where}: on_drift must be callable or None, got {on_drift!r}")
    if not callable(audit):
        raise TypeError(f"{where}: audit must be callable, got {audit!r}")
    _check_audit_call(audit, model_parts, device_mesh, audit_kwargs)
    steps = [0]

    def hook(_optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        steps[0] += 1
        if steps[0] % every:
            return
        result = audit(model_parts, device_mesh, **audit_kwargs)
        if result.ok:
            return
        if on_drift is None:
            raise AssertionError(f"after optimizer step {steps[0]}: {result}")
        on_drift(result)

    return optimizer.register_step_post_hook(hook)

