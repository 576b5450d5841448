"""Tensor-parallel style names and their torch equivalents.

Hugging Face models declare TP plans as ``{module glob: style name}``; fsdptx
applies them with torch's own ``parallelize_module`` and styles, so every TP
module is torch's. A name maps to a torch ``ParallelStyle`` for the plain
layout and another for sequence parallelism, where the residual stream
between blocks is sharded on the sequence dim (``Shard(1)``):

- ``colwise``: the output features are sharded; the input is replicated.
  Under SP the input arrives as ``Shard(1)``; the all-gather happens once at
  the enclosing module's boundary (see :class:`GatherSequence`), not once per
  projection, and so that a module that reshapes by its input's sequence
  length (Hugging Face attention) sees the whole sequence.
- ``rowwise``: the input features are sharded and the partial outputs are
  all-reduced; under SP they are reduce-scattered onto the sequence instead.
- ``colwise_rep`` (``colwise_gather_output``): colwise whose output is
  gathered (a replicated LM head).
- ``rowwise_rep`` (``rowwise_split_input``): rowwise whose input arrives
  replicated and is sliced here.
- ``embedding_colwise``: the embedding dim is sharded and gathered.
- ``embedding_rowwise`` / ``rowwise`` on an embedding: vocabulary-sharded
  lookup, partial outputs all-reduced; under SP too, since models derive
  positions from the embedding output's length: the first block of the
  stack keeps its rank's slice instead (:class:`ShardSequence`).
- ``sequence_parallel``: a norm run on the local sequence shard; its weight
  is a replicated DTensor, so DTensor sums its partial gradients.
- ``replicated_with_grad_allreduce``: not a torch style. The module stays a
  plain replica on every TP rank but sees only the rank's share of the work
  (q/k norms over the local heads), so its gradient is a partial sum: it
  becomes a TP-replica ``sum`` mark, reduced by
  :func:`fsdptx.synchronize_tp_replica_gradients`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "GatherSequence",
    "ShardSequence",
    "REPLICA_SUM_STYLES",
    "UNSUPPORTED_STYLES",
    "STYLE_NAMES",
    "describe_style",
    "style_for",
]

SEQ = Shard(1)

# name -> (plain factory, sequence-parallel factory)
_FACTORIES: dict[str, tuple[Callable[[], ParallelStyle], Callable[[], ParallelStyle]]] = {
    "colwise": (ColwiseParallel, ColwiseParallel),
    "rowwise": (RowwiseParallel, lambda: RowwiseParallel(output_layouts=SEQ)),
    "colwise_rep": (
        lambda: ColwiseParallel(output_layouts=Replicate()),
        lambda: ColwiseParallel(input_layouts=SEQ, output_layouts=Replicate()),
    ),
    "rowwise_rep": (
        lambda: RowwiseParallel(input_layouts=Replicate()),
        lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=SEQ),
    ),
    # Embeddings return the whole sequence under SP too: models derive
    # positions (rotary tables, masks) from the embedding output's length,
    # so the sequence is split where the first block receives it instead.
    "embedding_rowwise": (
        lambda: RowwiseParallel(input_layouts=Replicate()),
        lambda: RowwiseParallel(input_layouts=Replicate()),
    ),
    "embedding_colwise": (
        lambda: ColwiseParallel(output_layouts=Replicate()),
        lambda: ColwiseParallel(output_layouts=Replicate()),
    ),
    # Local outputs: norms whose output is added straight onto the plain
    # residual stream (Gemma's post-norms) must not hand back a DTensor. The
    # weight stays a replicated DTensor, so its partial gradients are summed.
    "sequence_parallel": (SequenceParallel, lambda: SequenceParallel(use_local_output=True)),
}
# Hugging Face 5.x spellings of the same layouts.
_FACTORIES["colwise_gather_output"] = _FACTORIES["colwise_rep"]
_FACTORIES["rowwise_split_input"] = _FACTORIES["rowwise_rep"]
# Style names that are TP-replica reductions, not torch styles.
REPLICA_SUM_STYLES = frozenset({"replicated_with_grad_allreduce"})
# Hugging Face style names with no torch equivalent (fused or packed weights,
# expert kernels working on local shards, expert-parallel dispatch) or that
# do nothing ("replicate"). A declared plan leaves those modules whole on
# every TP rank, where they compute redundantly and their gradients are
# TP-replica means; an explicit plan naming one is an error.
UNSUPPORTED_STYLES = frozenset(
    {
        "packed_colwise",
        "packed_rowwise",
        "moe_tp_experts",
        "mla_kv_a_proj",
        "moe_identity_expert",
        "local_params",
        "grouped_gemm",
        "ep_dispatch_experts",
        "all_reduce",
        "replicate",
        "local_colwise",
        "local_rowwise",
        "local",
        "gather",
        "ep_router",
    }
)
STYLE_NAMES = tuple(sorted((*_FACTORIES, *REPLICA_SUM_STYLES)))


def style_for(name: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    """The torch style for ``name`` on ``module``. ``rowwise`` on an
    embedding takes a replicated input (token ids are never sharded)."""
    plain, sp = _FACTORIES[name]
    if name == "rowwise" and isinstance(module, nn.Embedding):
        plain, sp = _FACTORIES["embedding_rowwise"]
    return sp() if sequence_parallel else plain()


_RELAID = "_fsdptx_relaid_by"


class _HiddenStatesInput(ParallelStyle):
    """Re-lays a module's hidden-states input (the first positional tensor,
    or the ``hidden_states`` keyword, as Hugging Face layers are called) and
    leaves every other argument alone. torch's ``PrepareModuleInput`` needs
    the exact number of positional inputs, which differs between
    architectures; these styles need none."""

    source: Placement
    target: Placement

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def convert(t: Any) -> Any:
            # A tensor this style produced is left alone: activation
            # checkpointing recomputes a block by calling it again with the
            # arguments it saved, which already went through this hook.
            if not isinstance(t, torch.Tensor) or getattr(t, _RELAID, None) is self:
                return t
            dt = t if isinstance(t, DTensor) else DTensor.from_local(t, device_mesh, (self.source,), run_check=False)
            out = dt.redistribute(device_mesh, (self.target,)).to_local()
            setattr(out, _RELAID, self)
            return out

        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            if args:
                return (convert(args[0]), *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": convert(kwargs["hidden_states"])}
            raise RuntimeError(
                f"{type(self).__name__} on {type(m).__name__}: found neither a positional input nor a "
                "hidden_states keyword; pass an explicit plan= for this module"
            )

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source} -> {self.target})"


class GatherSequence(_HiddenStatesInput):
    """Under sequence parallelism, all-gather a module's hidden states from
    ``Shard(1)`` to the full sequence at its boundary.

    Placed on the parent of colwise projections (attention, MLP), so the
    gather happens once per module rather than once per projection, and the
    module's own code (which may reshape by the input's sequence length) sees
    the full sequence.
    """

    source, target = SEQ, Replicate()


class ShardSequence(_HiddenStatesInput):
    """Under sequence parallelism, keep this TP rank's slice of the sequence
    as the first block receives the (replicated) embedding output: from here
    to the final norm the residual stream is ``Shard(1)``. A slice, no
    communication."""

    source, target = Replicate(), SEQ


def describe_style(style: ParallelStyle) -> str:
    """A short readable description of a torch style, for the Plan."""
    parts: list[str] = []
    for attr, label in (("input_layouts", "in"), ("output_layouts", "out")):
        value = getattr(style, attr, None)
        if isinstance(value, tuple):
            value = value[0] if len(value) == 1 else value
        if value is not None:
            parts.append(f"{label}={value}")
    if isinstance(style, SequenceParallel):
        parts.append(f"seq={style.sequence_sharding[0]}")
    if isinstance(style, PrepareModuleOutput):
        parts.append(f"out={style.output_layouts}->{style.desired_output_layouts}")
    return f"{type(style).__name__}({', '.join(parts)})"
