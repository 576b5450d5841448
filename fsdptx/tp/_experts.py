"""Tensor parallelism inside every expert of a grouped-experts module.

Hugging Face MoE layers keep all experts of a layer in one module whose
parameters are 3-D, ``(experts, out, in)``: a fused ``gate_up_proj`` (the
gate's output rows, then the up projection's) and a ``down_proj``. Torch has
no style for such a module, so fsdptx brings its own, :class:`ExpertsParallel`:

- every expert's gate and up projection is split by output row and its down
  projection by input column, each rank keeping the same slice of the
  intermediate features of every expert. A fused ``gate_up_proj`` is split
  *per half* (``_StridedShard(1, split_factor=2)``): the rank keeps its rows
  of the gate and the same rows of the up projection, so the kernel's
  ``chunk(2)`` pairs a gate row with its own up row. A plain ``Shard(1)``
  would hand rank 0 the whole gate and rank 1 the whole up projection;
- the module runs on the local shards (the parameters are DTensors between
  steps, for FSDP and checkpoints): its input is the whole set of tokens on
  every rank, each rank computes its slice of every expert's intermediate
  features, and the outputs, partial sums, are all-reduced;
- in backward the gradients of the module's inputs (the hidden states and
  the routing weights) are partial sums too and are all-reduced, so the
  router and everything before it see the full gradient on every rank:
  a router is a TP replica whose gradients agree, and needs no mark.

Under sequence parallelism the MoE block around the experts is usually
:class:`~fsdptx.tp._styles.ExpertsSequence`: the experts then hand their
partial sums on unreduced (``partial_output=True``) and the block
reduce-scatters them onto the sequence shard, one reduce-scatter where an
all-reduce and a slice would move twice the bytes (torchtitan's MoE
pattern: ``Partial`` output, ``Shard(1)`` desired).

The routing indices are integer tensors and pass through untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from ..core._torch_internals import StridedShard, functional_all_reduce

__all__ = ["EXPERTS_STYLE", "EXPERT_PARAM_STYLES", "ExpertsParallel", "expert_placement", "expert_split_dim"]

# The plan's style name for a grouped-experts module split inside every expert.
EXPERTS_STYLE = "moe_tp_experts"

# Style names a plan gives an expert module's 3-D parameters, and how each
# splits an ``(experts, out, in)`` weight: colwise by output row, packed
# colwise by output row within each of its two halves, rowwise by input column.
EXPERT_PARAM_STYLES = frozenset({"colwise", "packed_colwise", "rowwise"})


def expert_placement(style: str) -> Placement:
    """The TP placement of a 3-D expert weight under ``style`` (one of
    :data:`EXPERT_PARAM_STYLES`)."""
    if style == "packed_colwise":
        return StridedShard(1, split_factor=2)
    return Shard(1) if style == "colwise" else Shard(2)


def expert_split_dim(style: str, shape: tuple[int, ...]) -> tuple[int, str]:
    """The size that ``style`` divides over the TP ranks, and what it is:
    each half of a packed weight is split, so a half must divide."""
    if style == "packed_colwise":
        return shape[1] // 2, "half of dim 1 (packed gate|up)"
    return (shape[1], "dim 1 (out)") if style == "colwise" else (shape[2], "dim 2 (in)")


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) in forward; the gradient passes through: each rank's
    output is a partial sum, the sum's gradient is the same on every rank."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return functional_all_reduce(t, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the gradient in backward: the
    input feeds every rank's slice of the experts, so its full gradient is
    the sum of the ranks' partial ones."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return functional_all_reduce(grad, ctx.group), None


def _sum_grad(t: Any, group: dist.ProcessGroup) -> Any:
    """``t`` as a local tensor whose gradient is summed over ``group``;
    anything else (integer routing indices, ``None``) as it is."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        summed: torch.Tensor = _SumBackward.apply(t, group)  # type: ignore[no-untyped-call]
        return summed
    return t


@contextmanager
def _local_params(module: nn.Module, names: tuple[str, ...]) -> Iterator[None]:
    """Let ``module``'s forward read the local shards of its DTensor
    parameters: an instance attribute shadows the registered parameter (the
    module's ``_parameters`` stay as FSDP and the optimizer know them), and
    ``to_local`` carries the gradient back to the DTensor."""
    for name in names:
        p = module._parameters.get(name)
        if isinstance(p, DTensor):
            module.__dict__[name] = p.to_local()
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)


class ExpertsParallel(ParallelStyle):
    """Tensor parallelism inside every expert of a grouped-experts module
    (see the module docstring). ``params`` maps each parameter of the module
    to the style name that splits it (:data:`EXPERT_PARAM_STYLES`); the
    planner checks that it names every parameter the module holds.
    ``partial_output``: return each rank's partial sum unreduced, for a
    block that reduces it itself (:class:`~fsdptx.tp._styles.ExpertsSequence`).

    Example::

        style = ExpertsParallel({"gate_up_proj": "packed_colwise", "down_proj": "rowwise"})
        parallelize_module(model, tp_mesh, {"model.layers.0.mlp.experts": style})
    """

    def __init__(self, params: Mapping[str, str], *, partial_output: bool = False) -> None:
        super().__init__()
        self.params = dict(params)
        self.partial_output = partial_output

    def with_partial_output(self) -> ExpertsParallel:
        """A copy of this style (its class and settings) handing the
        partial sums on unreduced."""
        partial = copy.copy(self)
        partial.params = dict(self.params)
        partial.partial_output = True
        return partial

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, style in self.params.items():
            p = module._parameters[name]
            assert p is not None  # the planner names only present parameters
            # src_data_rank as torch's styles: rank 0's weights, whatever each rank initialized.
            dt = distribute_tensor(p.data, device_mesh, [expert_placement(style)], src_data_rank=self.src_data_rank)
            module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
        group = device_mesh.get_group()
        names = tuple(self.params)
        forward = module.forward

        def sharded_forward(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_sum_grad(a, group) for a in args)
            kwargs = {k: _sum_grad(v, group) for k, v in kwargs.items()}
            with _local_params(module, names):
                out = forward(*args, **kwargs)
            if isinstance(out, torch.Tensor) and self.partial_output:
                return out
            if isinstance(out, torch.Tensor):
                summed: torch.Tensor = _SumForward.apply(out, group)  # type: ignore[no-untyped-call]
                return summed
            raise TypeError(
                f"{type(module).__name__} returned {type(out).__name__}; moe_tp_experts expects the experts "
                "to return one tensor (the tokens' combined expert output)"
            )

        module.forward = sharded_forward
        return module

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}: {v}" for k, v in self.params.items())
        return f"{EXPERTS_STYLE}({inner}{'; partial sums out' if self.partial_output else ''})"
