"""Rendering a Plan as text: the fixed-width table ``str(plan)`` prints, and
the lines for its requests beyond FSDP units (tensor and expert parallelism,
checkpointing, prefetch), which ``python -m fsdptx plan`` prints as well.

Kept out of :mod:`fsdptx.plan._types` so that the records import no fsdptx
module (rendering needs ``core``'s name and size formatters). The Plan
(:mod:`fsdptx.plan._plan`) imports this module for ``__str__``, so this one
names the Plan only through :class:`PlanView`.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Mapping
from typing import Protocol

import torch

from ..core._names import ROOT, collapse_keyed, collapse_names, index_runs, join_names
from ..core._sizes import format_bytes
from ._types import (
    REDUCTIONS,
    Checkpointing,
    ExpertParallel,
    Prefetch,
    Reduction,
    StreamStep,
    TensorParallel,
    Unit,
    reshards_after_forward,
)

__all__ = ["PipelineView", "PlanView", "StageView", "format_pipeline", "format_plan", "format_requests", "fp32_input_casts"]


class PlanView(Protocol):
    """The Plan as rendering reads it: exactly the attributes used here,
    read-only. The Plan class (:mod:`fsdptx.plan._plan`) imports this module
    to render itself in ``__str__``, so this module cannot import the Plan
    without an import cycle; any :class:`~fsdptx.Plan` satisfies this."""

    @property
    def units(self) -> tuple[Unit, ...]: ...

    @property
    def warnings(self) -> tuple[str, ...]: ...

    @property
    def reductions(self) -> Mapping[str, Reduction]: ...

    @property
    def exclusions(self) -> tuple[str, ...]: ...

    @property
    def tensor_parallel(self) -> TensorParallel | None: ...

    @property
    def expert_parallel(self) -> ExpertParallel | None: ...

    @property
    def checkpointing(self) -> Checkpointing | None: ...

    @property
    def prefetch(self) -> tuple[Prefetch, ...]: ...

    @property
    def reduce_unused_params(self) -> bool: ...

    @property
    def pipeline(self) -> PipelineView | None: ...


class StageView(Protocol):
    """A pipeline stage as rendering reads it (:class:`fsdptx.plan._plan.Stage`)."""

    @property
    def index(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def modules(self) -> tuple[str, ...]: ...

    @property
    def plan(self) -> PlanView: ...

    @property
    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class PipelineView(Protocol):
    """A Plan's pipeline as rendering reads it (:class:`fsdptx.plan._plan.Pipeline`)."""

    @property
    def schedule(self) -> str: ...

    @property
    def microbatches(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def stages_per_rank(self) -> int: ...

    @property
    def placement(self) -> str: ...

    @property
    def stages(self) -> tuple[StageView, ...]: ...


def _dtype_name(d: torch.dtype | None) -> str:
    return "-" if d is None else str(d).removeprefix("torch.")


def format_plan(plan: PlanView) -> str:
    """Render the plan as a fixed-width table, one row per unit in order; a
    pipelined plan as its stage table, then each stage's own plan."""
    if plan.pipeline is not None:
        return format_pipeline(plan.pipeline, plan.warnings)
    header: tuple[str, ...] = ("#", "kind", "modules", "storage->compute", "params", "numel", "bytes", "reshard")
    why = any(u.reasons for u in plan.units)
    if why:
        header += ("why",)
    rows = [header]
    for i, u in enumerate(plan.units):
        row: tuple[str, ...] = (
            str(i),
            u.kind,
            join_names(u.modules),
            "-" if u.storage_dtype is None else f"{_dtype_name(u.storage_dtype)}->{_dtype_name(u.compute_dtype)}",
            str(len(u.params)),
            f"{u.numel:,}",
            format_bytes(u.nbytes),
            _reshard_cell(u),
        )
        rows.append(row + ("; ".join(u.reasons),) if why else row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [f"warning: {w}" for w in plan.warnings]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines.extend(table)
    total = sum(u.nbytes for u in plan.units)
    lines.append(f"{len(plan.units)} units, {format_bytes(total)} of parameters")
    casts = fp32_input_casts(plan)
    if casts:
        lines.append(
            f"fp32 input casts: {join_names(casts)} (every parameter below computes in fp32 inside a "
            "lower-precision model: apply_plan casts their floating inputs to fp32)"
        )
    if any(u.mesh != "dp" for u in plan.units):
        moe = [i for i, u in enumerate(plan.units) if u.mesh == "moe"]
        lines.append(f"sharded over the MoE mesh: units {index_runs(moe)}; all others over the dense mesh")
    lines.extend(format_requests(plan))
    if plan.reductions:
        counts = {r: sum(1 for v in plan.reductions.values() if v == r) for r in REDUCTIONS}
        lines.append(
            "tp-replica reductions: "
            + ", ".join(f"{n} {r}" for r, n in counts.items() if n)
            + " (unmarked replicated params: mean)"
        )
    if plan.exclusions:
        lines.append("excluded from tp-replica sync: " + join_names(plan.exclusions))
    return "\n".join(lines)


def fp32_input_casts(plan: PlanView) -> list[str]:
    """The modules whose floating inputs ``apply_plan`` casts to fp32: the
    modules of fp32 units whose every parameter, children's included,
    computes in fp32, in a plan where some unit computes in a lower
    precision (an fp32 router inside a bf16 block; see
    :mod:`fsdptx.apply._inputs`), read off the units' parameter FQNs."""
    if all(u.compute_dtype == torch.float32 for u in plan.units):
        return []
    fp32 = {p for u in plan.units if u.compute_dtype == torch.float32 for p in u.params}
    names = sorted({p for u in plan.units for p in u.params})
    found: list[str] = []
    for u in plan.units:
        if u.compute_dtype != torch.float32:
            continue
        for m in u.modules:  # a subtree's FQNs sort between "m." and "m/" ("/" follows ".")
            below = names[bisect_left(names, m + ".") : bisect_left(names, m + "/")] if m else names
            if below and fp32.issuperset(below):
                found.append(m)
    return found


def _reshard_cell(u: Unit) -> str:
    r = u.reshard_after_forward
    if type(r) is int and r > 1:
        return f"to {r} ranks"
    return str(reshards_after_forward(u))


def _format_stream(steps: tuple[StreamStep, ...]) -> list[str]:
    """The residual stream in the order the sequence-layout pass walked it,
    one row per pattern (block indices collapsed): what each module
    receives and hands on, and what the pass added there.

    The pass reads the model, never runs it: the embedding, the blocks
    and the final modules come in forward order, but inside a block its
    children come in the order the model registered them, which is the
    order its forward calls them only when the model was written that way
    (Hugging Face's Llama registers ``self_attn`` and ``mlp`` before the
    two norms it calls first). Every child of a block takes and gives the
    block's sequence layout, so the order does not change what is
    decided; the heading says which order it is."""
    if not steps:
        return []
    rows = collapse_keyed((s.module, (s.role, s.takes, s.gives, s.added or "")) for s in steps)
    width = max(len(label) for label, _key, _names in rows)
    out = [
        "  stream (blocks in forward order, a block's children in registration order): "
        "module  role  receives -> hands on  [added]"
    ]
    for label, (role, takes, gives, added), _names in rows:
        extra = f"  [{added}]" if added else ""
        out.append(f"    {label.ljust(width)}  {role}: {takes} -> {gives}{extra}")
    return out


def format_requests(plan: PlanView) -> list[str]:
    """The non-FSDP content of the Plan: TP styles, checkpointing, prefetch."""
    lines: list[str] = []
    tp = plan.tensor_parallel
    if tp is not None:
        rows = collapse_keyed((a.module, a.style) for a in tp.assignments)
        sp = " with sequence parallelism" if tp.sequence_parallel else ""
        lines.append(f"tensor parallel{sp}: {len(tp.assignments)} modules")
        width = max((len(label) for label, _style, _names in rows), default=0)
        for label, style, _names in rows:
            lines.append(f"  {label.ljust(width)}  {style}")
        for pattern, style, why in tp.skipped:
            lines.append(f"  {pattern.ljust(width)}  {style}: not a torch style, {why}")
        if tp.loss_parallel:
            lines.append("  loss parallel: the head's logits stay vocabulary-sharded; compute the loss under fsdptx.loss_parallel()")
        lines.extend(_format_stream(tp.stream))
    if plan.expert_parallel is not None:
        ep = plan.expert_parallel
        counts = sorted(set(ep.num_experts))
        lines.append(
            f"expert parallel: {len(ep.modules)} expert modules ({'/'.join(map(str, counts))} experts each), "
            f"{len(ep.params)} params Shard(0) over the moe mesh's ep dim, then FSDP over its data-parallel dims"
        )
        lines.extend(f"  {m}  Shard(0) on ep" for m in collapse_names(ep.modules))
    if plan.checkpointing is not None:
        ac = plan.checkpointing
        lines.append(f"activation checkpointing ({ac.mode}): " + join_names(ac.modules))
        if ac.kv_cache_off:
            lines.append(f"  turns off the KV cache (cannot be recomputed): {', '.join(ac.kv_cache_off)} = False")
    if plan.prefetch:
        fwd = max(len(p.forward) for p in plan.prefetch)
        bwd = max(len(p.backward) for p in plan.prefetch)
        lines.append(
            f"explicit prefetch: {len(plan.prefetch)} units, forward depth {fwd}, backward depth {bwd} "
            f"(e.g. {plan.prefetch[0].unit or ROOT} -> {', '.join(plan.prefetch[0].forward) or '-'})"
        )
    if plan.reduce_unused_params:
        lines.append("unused parameters: every unit reduce-scatters zeros for them (context parallelism)")
    return lines


def _in_order(names: tuple[str, ...]) -> str:
    """A stage's parts in forward order, each run of blocks collapsed
    (``embed_tokens, layers.{0..3}``)."""
    groups: list[list[str]] = []
    for name in names:
        shape = re.sub(r"\d+", "#", name)
        if groups and re.sub(r"\d+", "#", groups[-1][-1]) == shape:
            groups[-1].append(name)
        else:
            groups.append([name])
    return ", ".join(label for group in groups for label in collapse_names(group))


def format_pipeline(pipeline: PipelineView, warnings: tuple[str, ...] = ()) -> str:
    """The stage table (index, pipeline rank, parts, parameters), then each
    stage's plan, indented under its heading."""
    lines = [f"warning: {w}" for w in warnings]
    lines.append(
        f"pipeline: {len(pipeline.stages)} stages on pp={pipeline.size} ({pipeline.stages_per_rank} per rank, "
        f"{pipeline.placement} placement), schedule {pipeline.schedule}, {pipeline.microbatches} micro-batches"
    )
    header = ("stage", "pp rank", "modules", "params", "numel", "bytes")
    rows = [header] + [
        (
            str(s.index),
            str(s.rank),
            _in_order(s.modules),
            str(sum(len(u.params) for u in s.plan.units) or "-"),
            f"{s.numel:,}",
            format_bytes(s.nbytes),
        )
        for s in pipeline.stages
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    lines.extend(table)
    for s in pipeline.stages:
        lines.append("")
        lines.append(f"stage {s.index} (pp rank {s.rank}): {_in_order(s.modules)}")
        lines.extend("  " + line if line else line for line in format_plan(s.plan).splitlines())
    return "\n".join(lines)
