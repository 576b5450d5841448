"""Unused-parameter reduction: every FSDP unit under a module reduce-scatters
zeros for parameters a rank did not use, so ranks' collective sequences stay
identical. ``apply_plan`` carries out ``Plan.reduce_unused_params`` with it;
the seed-compatible API re-exports it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..core._args import require_module
from ..core._torch_internals import fsdp_param_groups, fsdp_state, unsharded_param

__all__ = ["configure_fsdp_unused_param_reduction", "configure_units_of"]


def configure_fsdp_unused_param_reduction(module: nn.Module) -> int:
    """Make every FSDP unit under ``module`` reduce-scatter zeros for unused
    parameters; returns the number of units configured.

    With packed or modality-dependent context-parallel batches a module may run
    on only some ranks. A rank whose gradient is ``None`` would otherwise skip
    the unit's reduce-scatter while its peers wait in it: the job hangs, or
    peers' contributions are lost. Zero-filling keeps the collective sequence
    identical everywhere, as DDP's unused-parameter handling does.

    Under mixed precision with gradient accumulation, torch's zero alone is
    not enough: a micro-batch run without gradient sync leaves the unit's
    gradients in the *reduce* dtype (fp32), while the zero for a parameter
    no micro-batch used is made in the *compute* dtype (bf16), and the
    reduce-scatter refuses the mix. So each unit's post-backward is wrapped
    (:func:`_align_reduce_dtypes`) to bring every gradient of the unit to one
    dtype first. Calling this twice wraps nothing twice.

    Args:
        module: a module already sharded with ``fully_shard`` (or holding
            such units).

    Returns:
        How many FSDP units were configured.

    Example::

        fsdptx.apply_plan(p, model, mesh)
        n = fsdptx.configure_fsdp_unused_param_reduction(model)
    """
    require_module(module, "module", "configure_fsdp_unused_param_reduction")
    return configure_units_of(module.modules())


def configure_units_of(modules: Iterable[nn.Module]) -> int:
    """:func:`configure_fsdp_unused_param_reduction` over ``modules``, every
    module of a model once (``apply_plan`` hands those its index found)."""
    seen: set[int] = set()
    for m in modules:
        if not isinstance(m, FSDPModule):
            continue
        state = fsdp_state(m)
        if id(state) in seen:
            continue  # a multi-module unit shares one state
        seen.add(id(state))
        m.set_reduce_scatter_unused_params(True, recurse=False)
        for group in fsdp_param_groups(state):
            _align_reduce_dtypes_before_post_backward(group)
    return len(seen)


_ALIGNING = "_fsdptx_aligns_reduce_dtypes"


def _align_reduce_dtypes_before_post_backward(group: Any) -> None:
    """Wrap one FSDP param group's ``post_backward`` (the instance attribute
    both of torch's call sites look up) so :func:`_align_reduce_dtypes` runs
    before it. torch's own files are left alone."""
    original = group.post_backward
    if getattr(original, _ALIGNING, False):
        return

    def post_backward(*args: Any) -> Any:
        if group.reduce_grads:  # the synced micro-batch: a reduce-scatter follows
            _align_reduce_dtypes(group)
        return original(*args)

    setattr(post_backward, _ALIGNING, True)
    group.post_backward = post_backward


def _align_reduce_dtypes(group: Any) -> None:
    """Give every gradient of ``group`` the reduce dtype once any has it.

    torch keeps the grads of micro-batches run without sync as
    ``unsharded_accumulated_grad`` in the reduce dtype; a grad first produced
    in this micro-batch (compute dtype) or the zero torch fills in for an
    unused parameter (compute dtype too) would then sit next to them. Moving
    those into ``unsharded_accumulated_grad`` in the reduce dtype, exactly as
    torch does for accumulated grads, makes the unit uniform; the values are
    the same (a cast of the grad, or zeros), so the reduction is unchanged.
    """
    params = [(fp, p) for fp in group.fsdp_params if (p := unsharded_param(fp)) is not None]
    if not any(fp.unsharded_accumulated_grad is not None for fp, _ in params):
        return
    for fp, param in params:
        if fp.unsharded_accumulated_grad is not None or fp.reduce_dtype is None:
            continue
        if param.grad is not None:
            fp.unsharded_accumulated_grad = param.grad.to(fp.reduce_dtype)
            param.grad = None
        elif group.reduce_scatter_unused_params and param.requires_grad:
            fp.unsharded_accumulated_grad = torch.zeros_like(param, dtype=fp.reduce_dtype)
