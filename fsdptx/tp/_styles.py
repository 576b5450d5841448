"""Tensor-parallel style names, their torch equivalents, and the four
boundary styles sequence parallelism adds where a plan leaves a gap.

Hugging Face models declare TP plans as ``{module glob: style name}``; fsdptx
applies them with torch's own ``parallelize_module`` and styles. A name does
not fix a layout by itself: which sequence layout a projection takes or
gives depends on where it sits on the residual stream (see
:mod:`fsdptx.tp._layout`), so :func:`style_for` builds the torch style for a
name from the layouts the sequence-layout pass decides:

- ``colwise``: output features sharded (``Shard(-1)``, a local tensor); the
  input is whatever the position hands it (the whole sequence inside a
  gathered region, ``Shard(1)`` on the stream).
- ``colwise_rep`` (``colwise_gather_output``): colwise whose output features
  are gathered back (a replicated LM head, Olmo2's q/k/v).
- ``rowwise``: input features sharded, partial outputs all-reduced to the
  whole sequence, or reduce-scattered onto it (``Shard(1)``) under sequence
  parallelism; on an embedding, a vocabulary-sharded lookup.
- ``rowwise_rep`` (``rowwise_split_input``): rowwise whose input arrives
  replicated and is sliced here.
- ``embedding_rowwise`` / ``embedding_colwise``: vocabulary- or
  embedding-dim-sharded lookups. Under sequence parallelism a
  vocabulary-sharded lookup reduce-scatters onto the sequence, as
  torchtitan's does, and returns a ``Shard(1)`` DTensor: models derive
  positions and masks from the embedding output's length, which a DTensor
  reports whole.
- ``sequence_parallel``: a norm run on the local sequence shard; its weight
  is a replicated DTensor, so DTensor sums its partial gradients.
- ``replicated_with_grad_allreduce``: not a torch style; the module stays a
  plain replica whose gradient is a partial sum (a TP-replica ``sum`` mark).

The boundary styles all act on a module's hidden-states input (the first
positional tensor, or the ``hidden_states`` keyword Hugging Face layers are
called with), leaving every other argument alone:

- :class:`ShardSequence` hands the first block this rank's slice as a
  plain tensor: a slice of a whole sequence (no communication), or the
  local part of a ``Shard(1)`` DTensor from the embedding.
- :class:`GatherSequence` all-gathers ``Shard(1)`` into the whole sequence at
  a region whose projections are all tensor-parallel. It hands the region a
  ``Replicate`` DTensor, as torchtitan's ``PrepareModuleInput`` does, so the
  colwise projections' partial input gradients add up as one DTensor and the
  backward is one reduce-scatter, not one all-reduce per projection.
- :class:`WholeSequence` gives a region the whole sequence as a plain tensor
  and slices its output back to ``Shard(1)``: for a region the plan leaves
  (partly) alone, such as DeepSeek-V3's MLA attention or a Mamba mixer, whose
  plain parameters cannot meet a DTensor.
- :class:`ExpertsSequence` gives a MoE block (a router beside experts split
  over TP) the whole sequence as a plain tensor, as :class:`WholeSequence`
  does, and reduce-scatters the experts' partial sums onto ``Shard(1)``:
  torchtitan's ``PrepareModuleInputOutput`` (``Partial`` out, ``Shard(1)``
  desired) instead of an all-reduce and a slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from ..core._torch_internals import tensor_base, version_counter
from ._experts import ExpertsParallel

__all__ = [
    "GatherSequence",
    "REPLICA_SUM_STYLES",
    "SEQ",
    "STYLE_NAMES",
    "ShardSequence",
    "StyleLayouts",
    "UNSUPPORTED_STYLES",
    "WholeSequence",
    "describe_style",
    "style_for",
    "style_layouts",
]

SEQ = Shard(1)
VOCAB = Shard(-1)
# The layouts a style name can be asked for: the whole sequence, this rank's
# sequence shard, or (a head's output) the vocabulary-sharded logits that
# loss parallelism reads.
Seq = Literal["whole", "shard", "vocab"]
_PLACEMENT: dict[str, Placement] = {"whole": Replicate(), "shard": SEQ, "vocab": VOCAB}

# Names -> how the torch style is built from (module, takes, gives).
_Factory = Callable[[nn.Module, Seq, Seq], ParallelStyle]


def _colwise(gathered: bool) -> _Factory:
    def build(module: nn.Module, takes: Seq, gives: Seq) -> ParallelStyle:
        del module
        if gives == "vocab":
            return ColwiseParallel(input_layouts=_PLACEMENT[takes], output_layouts=VOCAB, use_local_output=False)
        out = Replicate() if gathered else None
        return ColwiseParallel(input_layouts=_PLACEMENT[takes], output_layouts=out)

    return build


def _rowwise(replicated_input: bool) -> _Factory:
    def build(module: nn.Module, takes: Seq, gives: Seq) -> ParallelStyle:
        del takes
        embedding = isinstance(module, nn.Embedding)
        # Token ids are never sharded: a vocabulary-sharded lookup takes them
        # whole. Its partial lookups are reduce-scattered onto the sequence
        # under SP (torchtitan's layout) and handed on as a DTensor: models
        # derive positions and masks from the embedding output's length,
        # which a DTensor reports whole; the first block takes the local slice.
        whole_in = replicated_input or embedding
        local = not (embedding and gives == "shard")
        return RowwiseParallel(
            input_layouts=Replicate() if whole_in else None, output_layouts=_PLACEMENT[gives], use_local_output=local
        )

    return build


def _embedding_colwise(module: nn.Module, takes: Seq, gives: Seq) -> ParallelStyle:
    del module, takes, gives
    return ColwiseParallel(output_layouts=Replicate())


def _sequence_parallel(module: nn.Module, takes: Seq, gives: Seq) -> ParallelStyle:
    # A local output: norms whose output is added straight onto the plain
    # residual stream (Gemma's post-norms) must not hand back a DTensor.
    del module, takes, gives
    return SequenceParallel(use_local_output=True)


_FACTORIES: dict[str, _Factory] = {
    "colwise": _colwise(gathered=False),
    "colwise_rep": _colwise(gathered=True),
    "colwise_gather_output": _colwise(gathered=True),
    "rowwise": _rowwise(replicated_input=False),
    "rowwise_rep": _rowwise(replicated_input=True),
    "rowwise_split_input": _rowwise(replicated_input=True),
    "embedding_rowwise": _rowwise(replicated_input=True),
    "embedding_colwise": _embedding_colwise,
    "sequence_parallel": _sequence_parallel,
}
COLWISE_NAMES = frozenset({"colwise", "colwise_rep", "colwise_gather_output", "embedding_colwise"})
ROWWISE_NAMES = frozenset({"rowwise", "rowwise_rep", "rowwise_split_input", "embedding_rowwise"})
# Style names that are TP-replica reductions, not torch styles.
REPLICA_SUM_STYLES = frozenset({"replicated_with_grad_allreduce"})
# Hugging Face style names fsdptx does not apply (a fused Linear split per
# half, rope slices, expert-parallel dispatch) or that do nothing
# ("replicate"). A declared plan leaves those modules whole on every TP rank,
# where they compute redundantly and their gradients are TP-replica means;
# an explicit plan naming one is an error. ``moe_tp_experts`` with its
# parameters' ``packed_colwise``/``rowwise`` is fsdptx's own
# :class:`~fsdptx.tp._experts.ExpertsParallel`.
UNSUPPORTED_STYLES = frozenset(
    {
        "packed_colwise",
        "packed_rowwise",
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


def style_for(name: str, module: nn.Module, *, takes: Seq = "whole", gives: Seq = "whole") -> ParallelStyle:
    """The torch style for style ``name`` on ``module``, taking and giving
    the sequence layouts the position asks for (``"whole"``, ``"shard"``;
    ``"vocab"`` for a loss-parallel head's output). Layouts a name does not
    involve are ignored (a colwise output is always feature-sharded)."""
    return _FACTORIES[name](module, takes, gives)


@dataclass(frozen=True)
class StyleLayouts:
    """What a style does to a module's first input and its output, as far as
    the residual stream is concerned. ``takes``: how a *plain* input is read
    (``None``: left as it comes); a DTensor input is redistributed by the
    style whatever it declares. ``gives``: the output's placement (``None``:
    whatever the module computes), ``gives_dtensor`` whether it stays a
    DTensor."""

    takes: Placement | None
    gives: Placement | None
    gives_dtensor: bool


def _first(layouts: Any) -> Placement | None:
    if isinstance(layouts, tuple):
        return layouts[0] if layouts else None
    return layouts if isinstance(layouts, Placement) else None


def style_layouts(style: ParallelStyle) -> StyleLayouts:
    """The :class:`StyleLayouts` of a torch or fsdptx style; an unknown
    style is opaque (takes and gives whatever it is handed)."""
    if isinstance(style, _Boundary):
        return StyleLayouts(style.takes, style.gives, style.hands_dtensor)
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return StyleLayouts(_first(style.input_layouts), _first(style.output_layouts), not style.use_local_output)
    if isinstance(style, SequenceParallel):
        seq = _first(style.sequence_sharding)
        return StyleLayouts(seq, seq, not style.use_local_output)
    if isinstance(style, PrepareModuleInputOutput):
        inp, out = style.prepare_module_input, style.prepare_module_output
        return StyleLayouts(_first(inp.input_layouts), _first(out.desired_output_layouts), not out.use_local_output)
    if isinstance(style, PrepareModuleInput):
        return StyleLayouts(_first(style.input_layouts), None, False)
    if isinstance(style, PrepareModuleOutput):
        return StyleLayouts(None, _first(style.desired_output_layouts), not style.use_local_output)
    return StyleLayouts(None, None, False)


def region_input(style: ParallelStyle) -> tuple[Placement | None, bool]:
    """What a style hands its module's inside (the placement and whether as
    a DTensor): a ``PrepareModuleInput``'s desired layout, or ``None``."""
    prepare = style.prepare_module_input if isinstance(style, PrepareModuleInputOutput) else style
    if isinstance(prepare, PrepareModuleInput):
        return _first(prepare.desired_input_layouts), not prepare.use_local_output
    if isinstance(style, _Boundary):
        return style.inner, style.hands_dtensor
    return None, False


_RELAID = "_fsdptx_relaid_by"


def _relay(t: Any, style: object, mesh: DeviceMesh, source: Placement, target: Placement, local: bool) -> Any:
    """``t`` re-laid from ``source`` to ``target`` on ``mesh`` (a DTensor is
    taken at its own placement). A tensor this very style produced is left
    alone: activation checkpointing recomputes a block by calling it again
    with the arguments it saved, which already went through the hook."""
    if not isinstance(t, torch.Tensor) or getattr(t, _RELAID, None) is style:
        return t
    dt = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, (source,), run_check=False)
    relaid = dt.redistribute(mesh, (target,))
    out: torch.Tensor = relaid.to_local() if local else relaid
    setattr(out, _RELAID, style)
    return out


def _check_divisible(t: Any, mesh: DeviceMesh, where: str) -> None:
    """A whole sequence must split evenly over the TP ranks: DTensor would
    otherwise shard it unevenly and peers would disagree on every shape
    that follows (a wrong result on a fake mesh, a crashed rank on gloo)."""
    if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.dim() >= 2:
        size = mesh.size()
        if t.shape[1] % size:
            raise ValueError(
                f"sequence parallelism: {where} received a sequence of {t.shape[1]} positions, which is not "
                f"divisible by the tensor-parallel size {size}; pad or cut the batch to a multiple of {size}"
            )


def _hidden_states(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], style: object) -> tuple[str, Any]:
    if args:
        return "arg", args[0]
    if "hidden_states" in kwargs:
        return "kwarg", kwargs["hidden_states"]
    raise RuntimeError(
        f"{style!r} on {type(module).__name__}: found neither a positional input nor a hidden_states "
        "keyword; give this module an explicit torch style in the TP plan"
    )


class _Boundary(ParallelStyle):
    """A sequence boundary at a module's hidden-states input (and, for
    :class:`WholeSequence`, its output). ``takes``/``gives`` are the stream
    layouts around the module; ``inner`` what its inside receives."""

    takes: Placement
    gives: Placement | None
    inner: Placement
    hands_dtensor: bool = False
    slices_output: bool = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def before(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
            where, t = _hidden_states(m, args, kwargs, self)
            if self.takes == Replicate():
                _check_divisible(t, device_mesh, type(m).__name__)
            out = _relay(t, self, device_mesh, self.takes, self.inner, not self.hands_dtensor)
            if where == "arg":
                return (out, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": out}

        module.register_forward_pre_hook(before, with_kwargs=True)
        if self.slices_output:

            def after(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
                _where, full = _hidden_states(m, args, kwargs, self)
                length = full.shape[1] if isinstance(full, torch.Tensor) and full.dim() >= 2 else None
                return _slice_output(output, length, device_mesh)

            module.register_forward_hook(after, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _slice_output(output: Any, length: int | None, mesh: DeviceMesh) -> Any:
    """This rank's sequence slice of a whole-sequence output (the tensor, or
    the first element of a tuple: Hugging Face attention returns weights
    beside it). Anything not shaped like the sequence passes unchanged."""
    if isinstance(output, tuple) and output:
        return (_slice_output(output[0], length, mesh), *output[1:])
    if isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[1] == length:
        full = DTensor.from_local(output, mesh, (Replicate(),), run_check=False)
        return full.redistribute(mesh, (SEQ,)).to_local()
    return output


class ShardSequence(_Boundary):
    """Keep this TP rank's slice of the whole sequence where the first block
    receives it (the embedding returned it whole): from here to the final
    norm the residual stream is ``Shard(1)``. A slice, no communication."""

    takes, gives, inner = Replicate(), SEQ, SEQ


class GatherSequence(_Boundary):
    """All-gather a region's ``Shard(1)`` input into the whole sequence and
    hand it over as a ``Replicate`` DTensor (one reduce-scatter in backward
    for all the region's colwise projections together)."""

    takes, gives, inner = SEQ, None, Replicate()
    hands_dtensor = True


class WholeSequence(_Boundary):
    """Run a region on the whole sequence as plain tensors and hand its
    output back as this rank's ``Shard(1)`` slice. Its parameters compute
    the same thing on every TP rank, so their gradients agree (a ``mean``);
    the output's gradient is all-gathered on the way back."""

    takes, gives, inner = SEQ, SEQ, Replicate()
    slices_output = True


class ExpertsSequence(_Boundary):
    """Run a MoE block on the whole sequence as plain tensors and
    reduce-scatter its output, the partial sums of its ``experts`` (module
    paths inside the block, split by :class:`ExpertsParallel` with
    ``partial_output=True``), onto this rank's ``Shard(1)`` slice.

    The planner chooses it only for a block holding nothing but those
    experts and token-local holders (the router), whose output is the
    experts' output: a partial sum is only summed correctly if nothing
    whole was added to it. The forward checks that the block returns the
    experts' output (the tensor or a view of it, kept alive until the block
    returns, so no other tensor can pass for it) unchanged since they
    returned it (its version counter), and raises otherwise rather than
    reduce-scatter a mix of partial and whole values. Under
    ``torch.inference_mode()`` tensors keep no version counter: an in-place
    change of the experts' output there goes unseen. Backward: an all-gather
    of the output's gradient; the experts all-reduce their input gradients,
    so the router's gradients agree on every rank.

    Args:
        experts: paths of the experts modules inside the block, each
            non-empty (the block itself is not its experts).
        block: the block's FQN, for error messages.
    """

    takes, gives, inner = SEQ, SEQ, Replicate()

    def __init__(self, experts: tuple[str, ...], block: str = "") -> None:
        super().__init__()
        experts = tuple(experts)
        if not experts or not all(isinstance(e, str) and e for e in experts):
            raise ValueError(f"ExpertsSequence: experts must be non-empty module paths inside the block, got {experts!r}")
        self.experts = experts
        self.block = block

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        # The experts' outputs of the running forward with their version
        # counters, held until the block returns.
        seen: list[tuple[torch.Tensor, int | None]] = []

        def start(m: nn.Module, args: tuple[Any, ...]) -> None:
            seen.clear()

        def record(m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor):
                seen.append((output, version_counter(output)))

        for path in self.experts:
            module.get_submodule(path).register_forward_hook(record)

        def after(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            _where, full = _hidden_states(m, args, kwargs, self)
            length = full.shape[1] if isinstance(full, torch.Tensor) and full.dim() >= 2 else None
            first = output[0] if isinstance(output, tuple) and output else output
            unchanged = isinstance(first, torch.Tensor) and any(_unchanged_view(first, t, v) for t, v in seen)
            seen.clear()
            if not unchanged:
                raise RuntimeError(
                    f"{self.block or type(m).__name__!r} (experts_sequence): the block's output is not its experts' output "
                    f"{self.experts} as they returned it (another tensor, or changed in place), so it may mix "
                    "the experts' per-rank partial sums with whole values and cannot be reduce-scattered; "
                    "give the block fsdptx.tp.WholeSequence() in the TP plan: its experts then all-reduce"
                )
            return _reduce_scatter_output(output, length, device_mesh)

        module.register_forward_pre_hook(start)
        module.register_forward_hook(after, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"ExpertsSequence({', '.join(self.experts)})"


def _unchanged_view(out: torch.Tensor, expert_output: torch.Tensor, version: int | None) -> bool:
    """Whether ``out`` is ``expert_output`` or a view of the same storage,
    changed in no place since the experts returned it. Inference tensors
    keep no view base: their storages are compared instead."""
    if out.is_inference() or expert_output.is_inference():
        return out.untyped_storage().data_ptr() == expert_output.untyped_storage().data_ptr()
    return tensor_base(out) is tensor_base(expert_output) and version_counter(out) == version


def experts_pairing_problems(styles: Mapping[str, ParallelStyle]) -> list[str]:
    """Why the experts styles of ``styles`` (module FQN -> style) would
    compute a wrong result: every expert an :class:`ExpertsSequence` names
    must hand on partial sums for it to reduce (experts that all-reduce
    would be summed again, ``tp`` times), and experts that hand on partial
    sums must be inside a block that reduces them (else they reach the
    residual stream unreduced)."""
    problems: list[str] = []
    reduced: set[str] = set()
    for block, style in styles.items():
        if not isinstance(style, ExpertsSequence):
            continue
        for path in style.experts:
            fqn = f"{block}.{path}" if block else path
            reduced.add(fqn)
            experts = styles.get(fqn)
            if not isinstance(experts, ExpertsParallel) or not experts.partial_output:
                problems.append(
                    f"{block!r} (ExpertsSequence) reduce-scatters the partial sums of {fqn!r}, but {fqn!r} has "
                    f"{describe_style(experts) if experts is not None else 'no TP style'}; give it "
                    "ExpertsParallel(..., partial_output=True), or leave the block out of the plan (fsdptx "
                    "chooses its style)"
                )
    for fqn, style in styles.items():
        if isinstance(style, ExpertsParallel) and style.partial_output and fqn not in reduced:
            problems.append(
                f"{fqn!r} hands on its experts' partial sums (partial_output=True), but no ExpertsSequence block "
                "reduces them: they would reach the residual stream unreduced; give it partial_output=False"
            )
    return problems


def _reduce_scatter_output(output: Any, length: int | None, mesh: DeviceMesh) -> Any:
    """This rank's ``Shard(1)`` slice of the sum of the ranks' partial
    outputs (the tensor, or the first element of a tuple)."""
    if isinstance(output, tuple) and output:
        return (_reduce_scatter_output(output[0], length, mesh), *output[1:])
    if isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[1] == length:
        partial = DTensor.from_local(output, mesh, (Partial(),), run_check=False)
        return partial.redistribute(mesh, (SEQ,)).to_local()
    raise RuntimeError(f"experts_sequence: expected the block's output to be shaped like its input sequence ({length})")


def describe_style(style: ParallelStyle) -> str:
    """A short readable description of a torch style, for the Plan."""
    if isinstance(style, ExpertsParallel):
        return repr(style)
    layouts = style_layouts(style)
    parts: list[str] = []
    if layouts.takes is not None:
        parts.append(f"in={layouts.takes}")
    if layouts.gives is not None:
        parts.append(f"out={layouts.gives}")
    inner, _dtensor = region_input(style)
    if inner is not None and not isinstance(style, _Boundary):
        parts.append(f"inside={inner}")
    return f"{type(style).__name__}({', '.join(parts)})"
