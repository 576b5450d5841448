"""Test assertion over :func:`fsdptx.audit_replicas`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..tp._audit import ReplicaAudit, audit_replicas

__all__ = ["assert_replicas_in_sync"]


def assert_replicas_in_sync(
    model: nn.Module | Sequence[nn.Module], mesh: DeviceMesh, **kwargs: Any
) -> ReplicaAudit:
    """Fail the test when any replicated tensor differs across its peers.

    Runs :func:`fsdptx.audit_replicas` (collectives: call it on every rank
    of ``mesh`` at the same point) and raises ``AssertionError`` with a
    table of the drifted tensors (fqn, dim, ranks, max abs diff), the same
    table on every rank.

    Args:
        model: the model, or the model parts this rank holds.
        mesh: the mesh it was parallelized on.
        **kwargs: ``atol``, ``rtol``, ``buffers``, ``tp_axis_name``.

    Returns:
        The (clean) audit, for further checks.

    Raises:
        AssertionError: some copies differ.

    Example::

        fsdptx.testing.assert_replicas_in_sync(model, mesh, atol=1e-6)
    """
    audit = audit_replicas(model, mesh, **kwargs)
    if not audit.ok:
        raise AssertionError(str(audit))
    return audit
