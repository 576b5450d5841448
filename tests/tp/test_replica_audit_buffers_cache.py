"""The replica audit's cached layout is keyed by everything that shapes
it: an audit with ``buffers=True`` after one without compares the buffers
(and finds a drifted one), exactly as it does with caches off, and the
other way round compares none of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.testing import fake_mesh, run_distributed


class WithBuffers(nn.Module):
    """Two parameters and two buffers, all plain (replicated on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def checked(audit: fsdptx.ReplicaAudit) -> dict[str, int]:
    return dict(audit.checked)


@pytest.mark.parametrize("caches", [True, False], ids=["caches-on", "caches-off"])
def test_an_audit_with_buffers_after_one_without_compares_the_buffers(caches: bool) -> None:
    model = WithBuffers()
    with fake_mesh((2,), ("tp",)) as mesh, fsdptx.caches(enabled=caches):
        assert checked(fsdptx.audit_replicas([model], mesh)) == {"tp": 2}
        assert checked(fsdptx.audit_replicas([model], mesh, buffers=True)) == {"tp": 4}
        assert checked(fsdptx.audit_replicas([model], mesh)) == {"tp": 2}
        assert checked(fsdptx.audit_replicas([model], mesh, buffers=True)) == {"tp": 4}


def test_the_sync_layout_and_both_audits_each_keep_their_own_cached_layout() -> None:
    """A gradient sync between audits neither hides nor adds the buffers."""
    model = WithBuffers()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        with_buffers = checked(fsdptx.audit_replicas([model], mesh, buffers=True))
        fsdptx.synchronize_tp_replica_gradients([model], mesh)
        without = checked(fsdptx.audit_replicas([model], mesh))
        assert checked(fsdptx.audit_replicas([model], mesh, buffers=True)) == with_buffers == {"dp": 4, "tp": 4}
        assert without == {"dp": 2, "tp": 2}


def _drifted_buffer_worker(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = WithBuffers()
    with torch.no_grad():
        model.scale[1] += rank  # rank 1's copy drifts
    out: dict[str, Any] = {}
    out["params_only"] = fsdptx.audit_replicas([model], mesh).ok
    out["with_buffers"] = [(d.fqn, d.mesh_dim, d.ranks) for d in fsdptx.audit_replicas([model], mesh, buffers=True).drifted]
    with fsdptx.caches(enabled=False):
        out["caches_off"] = [(d.fqn, d.mesh_dim, d.ranks) for d in fsdptx.audit_replicas([model], mesh, buffers=True).drifted]
    return out


def test_a_drifted_buffer_is_found_by_an_audit_with_buffers_after_one_without() -> None:
    runs = run_distributed(_drifted_buffer_worker, 2, timeout_s=240, collective_timeout_s=60)
    for out in runs:
        assert out["params_only"] is True
        assert out["with_buffers"] == [("scale", "tp", (0, 1))]
        assert out["caches_off"] == out["with_buffers"]
