"""Gradient-norm clipping over every parameter a job trains, wherever it lives.

torch's ``clip_grad_norm_`` stacks the per-parameter norms, which fails
when DTensor gradients live on different meshes (the dense mesh, a MoE mesh,
a TP submesh) and, under pipeline parallelism, sees only this rank's stages.
Here every rank adds up its local shards' ``|g|^p``, each weighted by one
over the number of ranks holding the very same shard, and one all-reduce
over the world adds the ranks' sums: every parameter's every element is
then counted exactly once, whatever mesh or stage it is on, and the total
equals one process's norm over the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from ..core._tree import iter_unique_named_parameters

__all__ = ["clip_grad_norm_"]


def _parts(model_or_stages: object) -> tuple[list[nn.Module], int]:
    """The modules to clip and how many pipeline ranks split the model (a
    ``PipelineStages`` knows; a plain model or list is one stage)."""
    if isinstance(model_or_stages, nn.Module):
        return [model_or_stages], 1
    if isinstance(model_or_stages, Sequence) and model_or_stages and all(isinstance(m, nn.Module) for m in model_or_stages):
        pipeline = getattr(model_or_stages, "pipeline", None)
        return list(model_or_stages), int(getattr(pipeline, "size", 1))
    raise TypeError(
        "clip_grad_norm_: model_or_stages must be an nn.Module, a non-empty sequence of them or fsdptx.PipelineStages, "
        f"got {type(model_or_stages).__name__}"
    )


def _check_number(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"clip_grad_norm_: {name} must be a number, got {value!r}")
    return float(value)


def _agree(values: list[float], device: torch.device) -> None:
    """Every rank must clip with the same settings: the norm would differ
    otherwise, and a rank with another ``norm_type`` would issue another
    collective. One MAX over (x, -x) shows whether all ranks hold x; every
    rank raises alike."""
    encoded = torch.tensor([v for x in values for v in (x, -x)], dtype=torch.float64, device=device)
    encoded = torch.where(torch.isinf(encoded), torch.sign(encoded) * 1e300, encoded)
    seen = encoded.clone()
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if not torch.equal(seen[0::2], -seen[1::2]):
        raise RuntimeError(
            "clip_grad_norm_: ranks disagree about max_norm or norm_type; pass the same values on every rank "
            "(no gradient was changed)"
        )


def _reduce_partial(param: nn.Parameter) -> None:
    """A gradient DTensor left ``Partial`` (a sequence-parallel norm's: each
    TP rank holds its tokens' share) is reduced now, onto the parameter's
    own placements, and kept: its norm needs the sum, and the optimizer
    would reduce it anyway. Every TP peer holds the same parameters in the
    same order, so they issue the same reductions."""
    g = param.grad
    if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
        target = param.placements if isinstance(param, DTensor) else None
        placements = [
            (target[i] if target is not None else Replicate()) if isinstance(pl, Partial) else pl
            for i, pl in enumerate(g.placements)
        ]
        param.grad = g.redistribute(g.device_mesh, placements)


def clip_grad_norm_(
    model_or_stages: nn.Module | Sequence[nn.Module],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip every gradient of a model, its pipeline stages or its parts by
    one total norm, computed across pipeline stages and meshes.

    A gradient DTensor still ``Partial`` (sequence-parallel norms leave
    theirs so until the optimizer reads them) is reduced first and kept
    reduced. Plain (non-DTensor) gradients are taken to be replicas across the ranks
    that hold their stage (what TP-replica sync and data parallelism keep
    them); DTensor gradients count each distinct shard once. Collective:
    call it on every rank, after the backward (and after
    :func:`fsdptx.synchronize_tp_replica_gradients`), before
    ``optimizer.step()``.

    Args:
        model_or_stages: the model, the model parts this rank holds, or
            :class:`fsdptx.PipelineStages`.
        max_norm: the largest total norm left after clipping.
        norm_type: the ``p`` of the p-norm (``inf`` for the largest element).
        error_if_nonfinite: raise when the total norm is NaN or infinite
            (gradients are then left unchanged).

    Returns:
        The total norm before clipping (a float32 scalar tensor).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``max_norm`` negative or ``norm_type`` not positive.
        RuntimeError: ranks disagree about the settings, or
            (``error_if_nonfinite``) the norm is not finite.

    Example::

        loss.backward()
        total = fsdptx.clip_grad_norm_(stages, max_norm=1.0)
        optimizer.step()
    """
    parts, pp = _parts(model_or_stages)
    max_norm = _check_number(max_norm, "max_norm")
    p = _check_number(norm_type, "norm_type")
    if max_norm < 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    if p <= 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be positive (or inf), got {p}")
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"clip_grad_norm_: error_if_nonfinite must be a bool, got {error_if_nonfinite!r}")
    params = [param for _fqn, param in iter_unique_named_parameters(parts) if param.grad is not None]
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    holders = world // pp  # ranks that hold one stage
    device = params[0].grad.device if params and params[0].grad is not None else torch.device("cpu")
    if distributed and device.type == "meta":
        device = torch.device("cpu")
    if distributed:
        # Before the Partial reductions: a refused call changes no gradient.
        _agree([max_norm, p], device)
    for param in params:
        _reduce_partial(param)
    grads = [param.grad for param in params if param.grad is not None]
    inf = math.isinf(p)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        if isinstance(g, DTensor):
            local = g.to_local()
            mesh = g.device_mesh
            same = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, Replicate))
            copies = same * max(1, holders // mesh.size())
        else:
            local, copies = g, holders
        if local.numel() == 0:
            continue
        if inf:
            total = torch.maximum(total, local.detach().abs().max().to(torch.float64))
        else:
            total = total + torch.linalg.vector_norm(local.detach(), p, dtype=torch.float64).pow(p) / copies
    if distributed:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    norm = (total if inf else total.pow(1.0 / p)).to(torch.float32)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {p} is {float(norm)}; gradients left unchanged")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm
