"""``audit_replicas_every`` refuses at registration what the audit would
refuse at the N-th ``optimizer.step()`` (hours into a job): the model
parts, the mesh, the tolerances, ``buffers``, ``tp_axis_name``, and
keywords the audit does not take. A refused registration adds no hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fsdptx
from fsdptx.testing import fake_mesh


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


def hooks(opt: torch.optim.Optimizer) -> int:
    return len(opt._optimizer_step_post_hooks)


BAD: dict[str, tuple[Any, Any, dict[str, Any], type[Exception], str]] = {
    "model-a-string": ("gpt", "mesh", {}, TypeError, "model_parts must be an nn.Module"),
    "no-model-parts": ([], "mesh", {}, ValueError, "model_parts is empty"),
    "mesh-a-string": ("model", "dp,tp", {}, TypeError, "device_mesh must be a DeviceMesh, got str"),
    "atol-negative": ("model", "mesh", {"atol": -1.0}, ValueError, "atol must be finite and >= 0, got -1.0"),
    "rtol-a-string": ("model", "mesh", {"rtol": "0.1"}, TypeError, "rtol must be a non-negative number, got '0.1'"),
    "buffers-an-int": ("model", "mesh", {"buffers": 1}, TypeError, "buffers must be a bool, got 1"),
    "tp-axis-not-a-string": ("model", "mesh", {"tp_axis_name": 1}, TypeError, "tp_axis_name must be a str, got 1"),
    "unknown-keyword": ("model", "mesh", {"atoll": 1e-6}, TypeError, r"cannot call the audit with \['atoll'\].*its keywords are \['atol', 'rtol', 'buffers', 'tp_axis_name'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_argument_the_audit_would_refuse_is_refused_at_registration(case: str) -> None:
    parts, mesh_arg, kwargs, error, message = BAD[case]
    opt = optimizer()
    with fake_mesh((2,), ("tp",)) as mesh:
        model_parts = [nn.Linear(2, 2)] if parts == "model" else parts
        device_mesh = mesh if mesh_arg == "mesh" else mesh_arg
        with pytest.raises(error, match=rf"audit_replicas_every: {message}"):
            fsdptx.audit_replicas_every(opt, model_parts, device_mesh, 10, **kwargs)
    assert hooks(opt) == 0


def test_good_arguments_register_one_hook_that_audits_on_the_nth_step() -> None:
    """The refusals above come from the bad argument alone."""
    opt = optimizer()
    model = nn.Linear(2, 2)
    results: list[fsdptx.ReplicaAudit] = []

    def audit(parts: Any, mesh: Any, **kwargs: Any) -> fsdptx.ReplicaAudit:
        found = fsdptx.audit_replicas(parts, mesh, **kwargs)
        results.append(found)
        return found

    with fake_mesh((2,), ("tp",)) as mesh:
        handle = fsdptx.audit_replicas_every(opt, [model], mesh, 2, atol=1e-6, buffers=True, audit=audit)
        assert hooks(opt) == 1
        opt.step()
        assert results == []
        opt.step()
        assert len(results) == 1 and results[0].ok
    handle.remove()


def test_a_custom_audit_is_called_only_with_keywords_it_takes() -> None:
    opt = optimizer()

    def strict_audit(parts: Any, mesh: Any, *, level: int = 0) -> fsdptx.ReplicaAudit:
        return fsdptx.ReplicaAudit((), ())

    with pytest.raises(TypeError, match=r"cannot call the audit with \['atol'\].*its keywords are \['level'\]"):
        fsdptx.audit_replicas_every(opt, [nn.Linear(2, 2)], None, 1, audit=strict_audit, atol=0.1)  # type: ignore[arg-type]
    fsdptx.audit_replicas_every(opt, [nn.Linear(2, 2)], None, 1, audit=strict_audit, level=2)  # type: ignore[arg-type]
    assert hooks(opt) == 1


def test_on_drift_and_audit_must_be_callable() -> None:
    opt = optimizer()
    with pytest.raises(TypeError, match="audit_replicas_every: on_drift must be callable or None, got 'log'"):
        fsdptx.audit_replicas_every(opt, [nn.Linear(2, 2)], None, 1, on_drift="log", audit=lambda *a, **k: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="audit_replicas_every: audit must be callable, got 3"):
        fsdptx.audit_replicas_every(opt, [nn.Linear(2, 2)], None, 1, audit=3)  # type: ignore[arg-type]
    assert hooks(opt) == 0
