"""The sequence-layout pass: one walk of the residual stream that decides,
and checks, the sequence layout at every boundary of a TP plan.

Every style (a torch ``ParallelStyle``, a Hugging Face style name, one of
fsdptx's boundaries) is known by the layout it takes and gives on the
residual stream: the whole sequence or this rank's ``Shard(1)`` slice, as a
plain tensor or a DTensor (:func:`fsdptx.tp._styles.style_layouts`). The
pass walks the stream in forward order (the backbone's modules before the
block stack, in registration order, with the embedding first; each block and
its direct children; the backbone's modules after the stack; the output
head) and, under sequence parallelism:

- adds a boundary only where the plan leaves a gap: a slice where the first
  block receives the whole sequence, a gather at a region whose projections
  want it whole, a ``SequenceParallel`` norm, a gather before a head outside
  the plan; where the plan already shards the sequence (torchtitan's
  ``RowwiseParallel(output_layouts=Shard(1))`` embedding, its
  ``PrepareModuleInput`` regions) it adds nothing;
- gives a region the plan leaves (partly) alone the whole sequence
  (:class:`~fsdptx.tp._styles.WholeSequence`), so a hybrid or MLA model
  still runs its norms and residual stream on the shard;
- gives a MoE block holding only a router and experts split over TP
  (:class:`~fsdptx.tp._styles.ExpertsSequence`) the whole sequence and
  reduce-scatters the experts' partial sums back onto the shard;
- leaves small token-local holders (a module holding parameters directly,
  with no submodule of its own: sinks, gates) on the shard, where each rank
  sees only its tokens and their gradients get a TP-replica ``sum`` mark;
- refuses a plan whose layouts disagree anywhere (a sequence sliced twice,
  ``Shard(1)`` into a module that reads its input as the whole sequence, a
  stream left sharded at the head without loss parallelism), naming both
  modules.

Without sequence parallelism the stream stays whole and the pass only turns
style names into torch styles and refuses styles that would shard the
sequence. Pure: it reads the model through the planner's index.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from ..plan._types import StreamStep, TPAssignment, preview
from ..model._index import ModelIndex, unwrap_checkpoint
from ..model._gap import StageGap
from ..model._stages import STAGE_ATTRIBUTE
from ._experts import ExpertsParallel
from ._stream import _holds_params, _inside, _stack_glob, _Stream
from ._styles import (
    COLWISE_NAMES,
    ROWWISE_NAMES,
    SEQ,
    ExpertsSequence,
    GatherSequence,
    Seq,
    ShardSequence,
    WholeSequence,
    describe_style,
    experts_pairing_problems,
    region_input,
    style_for,
    style_layouts,
)

__all__ = ["LayoutResult", "StyleSpec", "sequence_layout"]

StyleSpec = str | ParallelStyle
Role = Literal["embedding", "module", "norm", "block", "region", "holder", "head"]
_SP = "<sequence parallel>"


@dataclass(frozen=True)
class _Lay:
    """A layout on the stream: ``seq`` is ``whole``, ``shard`` (``Shard(1)``),
    ``vocab`` (``Shard(-1)`` logits) or ``features`` (a colwise output);
    ``source`` the module that produced it, for error messages."""

    seq: str
    dtensor: bool
    source: str

    def __str__(self) -> str:
        name = {"whole": "whole", "shard": "Shard(1)", "vocab": "Shard(-1) vocab", "features": "Shard(-1) features"}
        return name.get(self.seq, self.seq) + (" DTensor" if self.dtensor else "")


def _seq_of(p: Placement | None) -> str:
    if p is None or isinstance(p, Replicate):
        return "whole"
    if isinstance(p, Shard):
        return "shard" if p.dim == 1 else "vocab" if p.dim == -1 else f"Shard({p.dim})"
    return str(p)


@dataclass
class LayoutResult:
    """What the pass decided: the torch style of every module (declared and
    added), the modules whose direct parameters need a ``sum`` mark, the
    stream's steps for the Plan, and the problems that refuse the plan."""

    assignments: dict[str, TPAssignment] = field(default_factory=dict)
    sums: list[str] = field(default_factory=list)
    steps: list[StreamStep] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class _Pass:
    """Scratch state of one pass; never escapes :func:`sequence_layout`."""

    index: ModelIndex
    declared: Mapping[str, tuple[str, StyleSpec]]
    sum_marked: Collection[str]
    sp: bool
    loss_parallel: bool
    out: LayoutResult = field(default_factory=LayoutResult)
    # Layouts a style name is built with (takes, gives); names not visited
    # by the walk get the plain ("whole", "whole") ones.
    want: dict[str, tuple[Seq, Seq]] = field(default_factory=dict)

    def problem(self, text: str) -> None:
        self.out.problems.append(text)

    def add(self, fqn: str, name: str, style: ParallelStyle) -> None:
        self.out.assignments[fqn] = TPAssignment(fqn, name, _SP, style)

    def step(self, fqn: str, role: Role, takes: _Lay | str, gives: _Lay | str, added: str | None = None) -> None:
        self.out.steps.append(StreamStep(fqn, role, str(takes), str(gives), added))

    def explicit(self, fqn: str) -> ParallelStyle | None:
        """The torch style object the plan gives ``fqn`` (``None`` for a name or none)."""
        entry = self.declared.get(fqn)
        return entry[1] if entry is not None and isinstance(entry[1], ParallelStyle) else None

    def name(self, fqn: str) -> str | None:
        entry = self.declared.get(fqn)
        return entry[1] if entry is not None and isinstance(entry[1], str) else None

    def check_takes(self, fqn: str, style: ParallelStyle, cur: _Lay) -> None:
        """A plain input is read as the style declares: it must be laid out
        that way. A DTensor input is redistributed by the style itself."""
        takes = style_layouts(style).takes
        if takes is None or cur.dtensor or _seq_of(takes) == cur.seq:
            return
        self.problem(
            f"{fqn!r} ({describe_style(style)}) reads its input as {_Lay(_seq_of(takes), False, '')} but "
            f"receives {cur} from {cur.source or 'the model input'!r}; give one of the two the layout of the other"
        )


def sequence_layout(
    model: nn.Module,
    index: ModelIndex,
    declared: Mapping[str, tuple[str, StyleSpec]],
    blocks: tuple[str, ...],
    *,
    sum_marked: Collection[str] = (),
    sequence_parallel: bool,
    loss_parallel: bool,
) -> LayoutResult:
    """Decide the torch style of every module in ``declared`` (module FQN ->
    (pattern, style name or torch style)) and the boundaries the stream
    needs; see the module docstring. ``blocks`` are the model's blocks in
    order; ``sum_marked`` the modules the plan already marks ``sum``."""
    p = _Pass(index, declared, sum_marked, sequence_parallel, loss_parallel)
    if sequence_parallel and "" in blocks:
        p.problem(
            "sequence_parallel=True, but blocks= names the root: the sequence shard would have to enter before "
            "the embedding and leave after the head; name the repeated blocks instead (e.g. 'layers.*')"
        )
        return p.out
    stream = _Stream.of(model, index, declared, blocks, sequence_parallel)
    if sequence_parallel and not stream.blocks:
        p.problem(
            "sequence_parallel=True, but no blocks were found to run on the sequence shard; name them with "
            "FSDP2Config(blocks=...) or tensor_parallel(blocks=...), or declare _no_split_modules"
        )
    elif sequence_parallel and stream.left_out:
        p.problem(
            f"sequence_parallel=True, but the blocks leave out {preview(stream.left_out)} beside "
            f"{preview(stream.blocks, 2)}: the sequence-layout pass would not cover them, so they would run "
            "on the sequence shard with their TP styles reading it as the whole sequence and their norms' "
            "gradients left partial; name every block of the stack in blocks= (a glob such as "
            f"'{_stack_glob(stream.blocks)}', or the container itself)"
        )
    else:
        _walk(p, stream, model)
    for fqn, (pattern, spec) in declared.items():
        if fqn in p.out.assignments:
            continue
        if isinstance(spec, str):
            takes, gives = p.want.get(fqn, ("whole", "whole"))
            p.out.assignments[fqn] = TPAssignment(fqn, spec, pattern, style_for(spec, index.modules[fqn], takes=takes, gives=gives))
        else:
            p.out.assignments[fqn] = TPAssignment(fqn, describe_style(spec), pattern, spec)
    p.out.problems.extend(experts_pairing_problems({f: a.parallel_style for f, a in p.out.assignments.items()}))
    return p.out


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _children(index: ModelIndex, fqn: str) -> list[str]:
    """The children of ``fqn`` that hold parameters, seeing through
    activation-checkpoint wrappers, in registration order."""
    inner = unwrap_checkpoint(index.modules[fqn])
    base = index.fqn_of(inner)
    return [
        f for n, c in inner._modules.items() if c is not None and _holds_params(index, f := f"{base}.{n}" if base else n)
    ]


def _stage_position(model: nn.Module) -> tuple[bool, bool]:
    """Whether the model is a pipeline stage after the first (the stream
    enters as the previous stage's output) and before the last (it leaves
    for the next stage, with no head of its own)."""
    stage = getattr(model, STAGE_ATTRIBUTE, None)
    if stage is None:
        return False, False
    index, count = stage
    return index > 0, index < count - 1


def _walk(p: _Pass, s: _Stream, model: nn.Module) -> None:
    after_first, before_last = _stage_position(model)
    # A later pipeline stage receives what the previous one handed on: under
    # sequence parallelism, each rank's plain Shard(1) slice.
    cur = _Lay("shard" if p.sp and after_first else "whole", False, "<previous pipeline stage>" if after_first else "")
    for fqn in s.pre:
        if fqn == s.embedding:
            cur = _embedding(p, fqn, cur)
        elif p.sp and cur.seq == "shard":
            cur = _on_stream(p, fqn, cur)
        elif not p.sp:
            _plain_module(p, fqn, cur)
    for i, block in enumerate(s.blocks):
        cur = _block(p, block, cur, first=i == 0)
    for fqn in s.post:
        cur = _on_stream(p, fqn, cur) if p.sp else _plain_module(p, fqn, cur)
    if before_last:
        p.step("<next pipeline stage>", "module", cur, cur, None)  # handed on as it is
        return
    _head(p, s.head, cur)


def _embedding(p: _Pass, fqn: str, cur: _Lay) -> _Lay:
    style = p.explicit(fqn)
    name = p.name(fqn)
    if style is not None:
        lay = style_layouts(style)
        gives = _Lay(_seq_of(lay.gives), lay.gives_dtensor, fqn)
    elif name is not None:
        # A vocabulary-sharded lookup reduce-scatters onto the sequence and
        # hands on a Shard(1) DTensor, whose length reads whole (models
        # derive positions from it); the first block takes the local slice.
        shard = p.sp and name in ROWWISE_NAMES and isinstance(p.index.modules[fqn], nn.Embedding)
        p.want[fqn] = ("whole", "shard" if shard else "whole")
        gives = _Lay("shard" if shard else "whole", shard, fqn)
    else:
        gives = _Lay("whole", False, fqn)
    if gives.seq == "shard" and not p.sp:
        p.problem(
            f"{fqn!r} shards the sequence ({describe_style(style) if style else name}) but sequence_parallel=False; "
            "pass sequence_parallel=True, or give it output_layouts=Replicate()"
        )
    p.step(fqn, "embedding", "token ids", gives)
    return gives


def _block(p: _Pass, block: str, cur: _Lay, *, first: bool) -> _Lay:
    style = p.explicit(block)
    added = None
    if style is not None:
        p.check_takes(block, style, cur)
        handed = region_input(style)[0] or style_layouts(style).gives
        inside = _Lay(_seq_of(handed), False, block) if handed is not None else cur
    elif p.sp and first and (cur.seq == "whole" or cur.dtensor):
        p.add(block, "shard_sequence (sp)", ShardSequence())
        added = "slice: keeps this rank's Shard(1)" if cur.seq == "whole" else "takes the local Shard(1)"
        inside = _Lay("shard", False, block)
    else:
        inside = _Lay(cur.seq, cur.dtensor, cur.source)
    if p.sp and inside.seq != "shard":
        p.problem(
            f"sequence_parallel=True, but block {block!r} receives {inside} from {inside.source or 'the model input'!r}; "
            "the blocks must run on the Shard(1) sequence shard"
        )
    if not p.sp and inside.seq == "shard":
        p.problem(f"block {block!r} receives the sequence shard from {inside.source!r}, but sequence_parallel=False")
    p.step(block, "block", cur, inside, added)
    if p.sp:
        if unwrap_checkpoint(p.index.modules[block])._parameters:
            _holder(p, p.index.fqn_of(unwrap_checkpoint(p.index.modules[block])), direct_only=True)
        for child in _children(p.index, block):
            _on_stream(p, child, _Lay("shard", False, block))
    else:
        for child in _children(p.index, block):
            _plain_module(p, child, inside)
    return _Lay(inside.seq, False, block)


def _declared_inside(p: _Pass, fqn: str) -> list[str]:
    return sorted(f for f in p.declared if f.startswith(fqn + "."))


def _on_stream(p: _Pass, fqn: str, cur: _Lay) -> _Lay:
    """A module that reads the sequence-sharded stream (a block's child, or
    a backbone module after the stack); returns the stream after it."""
    module = p.index.modules[fqn]
    style, name = p.explicit(fqn), p.name(fqn)
    if style is not None:
        p.check_takes(fqn, style, cur)
        if isinstance(style, ExpertsParallel):
            _experts_on_shard(p, fqn, "the residual stream")
        lay = style_layouts(style)
        gives = _Lay(_seq_of(lay.gives), lay.gives_dtensor, fqn) if lay.gives is not None else cur
        inner = _declared_inside(p, fqn)
        if inner:
            handed = region_input(style)[0]
            _region_inside(p, fqn, inner, gathered=handed is not None and _seq_of(handed) == "whole", whole=False)
        p.step(fqn, _role(module), cur, gives)
        return _Lay("shard", False, fqn) if gives.seq == "shard" else gives
    if name is not None:
        if name == "sequence_parallel" or name in COLWISE_NAMES | ROWWISE_NAMES:
            p.want[fqn] = ("shard", "shard")
        p.step(fqn, _role(module), cur, _Lay("shard", False, fqn))
        return cur
    inner = _declared_inside(p, fqn)
    if not inner:
        if _is_norm(module) and module._parameters:
            p.add(fqn, "sequence_parallel (sp)", style_for("sequence_parallel", module))
            p.step(fqn, "norm", cur, _Lay("shard", False, fqn), "SequenceParallel")
        elif _compound(p.index, fqn):
            p.add(fqn, "whole_sequence (sp)", WholeSequence())
            p.step(fqn, "region", cur, _Lay("shard", False, fqn), "gather in, slice out: no TP style inside")
        else:
            _holder(p, fqn, direct_only=False)
            p.step(fqn, "holder", cur, cur, "runs on the shard: gradients summed over TP")
        return cur
    experts = _moe_block_experts(p, fqn, inner)
    if experts:
        base = p.index.fqn_of(unwrap_checkpoint(module))
        p.add(fqn, "experts_sequence (sp)", ExpertsSequence(tuple(f.removeprefix(base + ".") for f in experts), fqn))
        for f in experts:
            pattern, spec = p.declared[f]
            assert isinstance(spec, ExpertsParallel)  # _moe_block_experts checked
            partial = spec.with_partial_output()
            p.out.assignments[f] = TPAssignment(f, describe_style(partial), pattern, partial)
        p.step(fqn, "region", cur, _Lay("shard", False, fqn), "gather in, reduce-scatter the experts' partial sums out")
        return cur
    uncovered = _uncovered(p, fqn, inner)
    gathers_itself = _gathers_itself(p, inner)
    if gathers_itself:
        _region_inside(p, fqn, inner, gathered=False, whole=False)
        p.step(fqn, "region", cur, _Lay("shard", False, fqn))
    elif uncovered:
        p.add(fqn, "whole_sequence (sp)", WholeSequence())
        _region_inside(p, fqn, inner, gathered=True, whole=True)
        p.step(
            fqn, "region", cur, _Lay("shard", False, fqn),
            f"gather in, slice out: {preview(uncovered)} outside the TP styles",
        )
    else:
        p.add(fqn, "gather_sequence (sp)", GatherSequence())
        _region_inside(p, fqn, inner, gathered=True, whole=False)
        p.step(fqn, "region", cur, _Lay("shard", False, fqn), "all-gather in as a Replicate DTensor")
    return cur


def _role(module: nn.Module) -> Role:
    return "norm" if _is_norm(module) else "region"


def _compound(index: ModelIndex, fqn: str) -> bool:
    """Whether a submodule of ``fqn`` holds parameters: an attention, mixer
    or MLP is compound; a holder of its own parameters (sinks, a gate) is not."""
    module = unwrap_checkpoint(index.modules[fqn])
    base = index.fqn_of(module)
    return any(c is not None and _holds_params(index, f"{base}.{n}" if base else n) for n, c in module._modules.items())


def _holder(p: _Pass, fqn: str, *, direct_only: bool) -> None:
    """Token-local parameters on the shard: each TP rank's gradient covers
    only its tokens, so the replicas need the sum."""
    if direct_only:
        p.out.sums.append(fqn)
        return
    for f, m in p.index.modules.items():
        if _inside(f, fqn) and m._parameters:
            p.out.sums.append(f)


def _subtree(index: ModelIndex, fqn: str) -> Iterator[tuple[str, nn.Module]]:
    """``fqn`` and every module below it, in walk order: a slice of the
    index, not a scan of the whole model."""
    at = index.walk.position[id(index.modules[fqn])]
    end = index.subtree_end[at]
    return zip(index.module_fqns[at:end], index.walk.modules[at:end])


def _moe_block_experts(p: _Pass, region: str, inner: list[str]) -> list[str]:
    """The experts of ``region`` if it is a MoE block whose output can only
    be its experts' partial sums: every TP style inside it splits experts,
    and every other parameter sits on a router-like holder, a direct child
    holding parameters but no submodules that do. A shared expert, a norm
    or a parameter of the block itself (whole values that could be added to
    the output) leave it to :class:`WholeSequence` (``[]``)."""
    if not p.sp or not inner or not all(isinstance(p.explicit(f), ExpertsParallel) for f in inner):
        return []
    base = p.index.fqn_of(unwrap_checkpoint(p.index.modules[region]))
    for f, m in _subtree(p.index, region):
        if not m._parameters or any(_inside(f, e) for e in inner):
            continue
        if f.rpartition(".")[0] not in (region, base) or _compound(p.index, f) or _is_norm(m):
            return []
    return inner


def _uncovered(p: _Pass, region: str, inner: list[str]) -> list[str]:
    """Modules of a region holding parameters that no TP style covers, other
    than norms and what the plan marks ``sum`` (q/k norms of the local heads):
    their plain parameters cannot meet a DTensor input."""
    found = []
    for f, m in _subtree(p.index, region):
        if not m._parameters or f in p.declared or f in p.sum_marked:
            continue
        if any(_inside(f, s) for s in inner) or _is_norm(m):
            continue
        found.append(f)
    return found


def _gathers_itself(p: _Pass, inner: list[str]) -> bool:
    """Whether the plan's own torch styles read the region's input as the
    sequence shard (colwise with ``input_layouts=Shard(1)``, or a
    ``PrepareModuleInput`` inside): then nothing is added."""
    entries = [p.explicit(f) for f in inner]
    takes = [style_layouts(s).takes for s in entries if isinstance(s, (ColwiseParallel, PrepareModuleInput))]
    return bool(takes) and all(_seq_of(t) == "shard" for t in takes)


def _region_inside(p: _Pass, region: str, inner: list[str], *, gathered: bool, whole: bool) -> None:
    """Layouts inside a region: its colwise projections read the whole
    sequence the region was handed; its rowwise projections give the
    ``Shard(1)`` stream back (reduce-scatter), or the whole sequence inside
    a :class:`WholeSequence` region, which slices it. An explicit torch
    style that disagrees is refused."""
    exit_seq: Seq = "whole" if whole or not p.sp else "shard"
    for f in inner:
        name, style = p.name(f), p.explicit(f)
        if isinstance(style, ExpertsParallel) and p.sp and not gathered:
            _experts_on_shard(p, f, f"region {region!r}, which the plan's own styles run on the shard")
        if name is not None:
            if name in COLWISE_NAMES:
                p.want[f] = ("whole" if gathered or not p.sp else "shard", "whole")
            elif name in ROWWISE_NAMES:
                p.want[f] = ("whole", exit_seq)
            continue
        if isinstance(style, RowwiseParallel):
            gives = _seq_of(style_layouts(style).gives)
            if gives != exit_seq:
                where = "its region runs on the whole sequence and slices it itself" if whole else (
                    "it hands the region's output back to the Shard(1) stream"
                )
                p.problem(
                    f"{f!r} ({describe_style(style)}) gives {_Lay(gives, False, '')} but {where}; "
                    f"give it output_layouts={'Replicate()' if exit_seq == 'whole' else 'Shard(1)'}"
                )
        elif isinstance(style, ColwiseParallel) and gathered and _seq_of(style_layouts(style).takes) == "shard":
            p.problem(
                f"{f!r} ({describe_style(style)}) reads its input as the Shard(1) shard, but its region "
                f"{region!r} is handed the whole sequence; give it input_layouts=Replicate()"
            )


def _experts_on_shard(p: _Pass, fqn: str, where: str) -> None:
    """Experts split over TP sum the ranks' partial outputs token by token:
    every TP rank must run them on the same tokens. On the sequence shard
    each rank holds other tokens, and the sum would mix them."""
    p.problem(
        f"{fqn!r} (moe_tp_experts) sits on {where}, so each TP rank would run its slice of the experts on "
        "other tokens and the all-reduce would add unrelated outputs; put the experts inside a module the "
        "plan runs on the whole sequence (their MoE block, beside its router), or drop them from the plan"
    )


def _plain_module(p: _Pass, fqn: str, cur: _Lay) -> _Lay:
    """Without sequence parallelism: names take and give the whole
    sequence; a torch style that would shard it is refused."""
    style = p.explicit(fqn)
    targets = [fqn, *_declared_inside(p, fqn)]
    for f in targets:
        s = p.explicit(f)
        if s is not None and _seq_of(style_layouts(s).gives) == "shard" and not isinstance(s, SequenceParallel):
            p.problem(f"{f!r} ({describe_style(s)}) shards the sequence, but sequence_parallel=False")
        if isinstance(s, SequenceParallel):
            p.problem(f"{f!r} has SequenceParallel, but sequence_parallel=False")
    if style is not None:
        p.check_takes(fqn, style, cur)
    return cur


def _head(p: _Pass, head: str | None, cur: _Lay) -> None:
    """The output head: logits for the whole sequence (``Replicate``), or
    vocabulary-sharded under loss parallelism; never the sequence shard."""
    if head is None:
        if p.sp:
            p.problem(
                "sequence_parallel=True, but the model has no output head to gather the sequence shard "
                "(neither get_output_embeddings() nor a root lm_head): its output would be each rank's "
                "slice of the sequence; use sequence_parallel=False for a backbone"
            )
        elif p.loss_parallel:
            p.problem("loss_parallel=True needs an output head (get_output_embeddings() or a root lm_head)")
        return
    style, name = p.explicit(head), p.name(head)
    module = p.index.modules[head]
    added = None
    if style is not None:
        p.check_takes(head, style, cur)
        lay = style_layouts(style)
        gives = _Lay(_seq_of(lay.gives), lay.gives_dtensor, head)
    elif name is not None:
        if name not in COLWISE_NAMES - {"embedding_colwise"}:
            p.problem(f"output head {head!r} has style {name!r}; an output head takes colwise or colwise_rep")
            return
        vocab = p.loss_parallel or name == "colwise"
        p.want[head] = (cur.seq if cur.seq in ("whole", "shard") else "whole", "vocab" if p.loss_parallel else "whole")  # type: ignore[assignment]
        gives = _Lay("vocab" if vocab else "whole", p.loss_parallel, head)
    elif p.loss_parallel:
        takes: Seq = "shard" if cur.seq == "shard" else "whole"
        p.add(head, "colwise (loss parallel)", style_for("colwise", module, takes=takes, gives="vocab"))
        gives, added = _Lay("vocab", True, head), "colwise: vocabulary-sharded logits"
    elif cur.seq == "shard":
        gather = PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True)
        p.add(head, "gather_sequence_input (sp)", gather)
        gives, added = _Lay("whole", False, head), "all-gather the sequence in"
    else:
        gives = _Lay("whole", False, head)
    if gives.seq == "shard":
        p.problem(
            f"output head {head!r} gives each rank's Shard(1) slice of the sequence (the stream is left sharded); "
            "give it input_layouts=Shard(1) with output_layouts=Replicate(), or loss_parallel=True"
        )
    elif gives.seq == "vocab" and not p.loss_parallel:
        p.problem(
            f"output head {head!r} gives vocabulary-sharded logits but loss_parallel=False; pass "
            "loss_parallel=True and compute the loss under fsdptx.loss_parallel(), or gather its output (colwise_rep)"
        )
    elif gives.seq == "vocab" and not gives.dtensor:
        p.problem(
            f"output head {head!r} gives vocabulary-sharded logits as a plain tensor; loss parallelism needs "
            "the DTensor: give it use_local_output=False"
        )
    elif p.loss_parallel and gives.seq != "vocab":
        p.problem(
            f"loss_parallel=True, but output head {head!r} gives {gives}; give it "
            "ColwiseParallel(output_layouts=Shard(-1), use_local_output=False), or drop its entry from the plan"
        )
    p.step(head, "head", cur, gives, added)
