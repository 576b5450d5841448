"""The ``tensor_parallel`` transform and the checks a TP plan must pass.

Patterns are resolved to concrete module FQNs when planning, so the Plan says
exactly which module gets which torch style, and ``apply_plan`` hands torch's
``parallelize_module`` one dict of concrete names. The checks that need the
TP size (divisibility) are a separate pure function, run by ``apply_plan``
and by the manager's dry run before anything is mutated.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor import Replicate

from ..planning._plan import Plan, Reduction, TensorParallel, TPAssignment
from ..planning._plan import preview
from ..planning._planner import ModelIndex, PlanningError
from ._styles import (
    REPLICA_SUM_STYLES,
    UNSUPPORTED_STYLES,
    SEQ,
    STYLE_NAMES,
    GatherSequence,
    ShardSequence,
    describe_style,
    style_for,
)

__all__ = ["check_tensor_parallel", "declared_tp_plan", "segment_match", "tensor_parallel"]

StyleSpec = str | ParallelStyle


def segment_match(pattern: str, fqn: str) -> bool:
    """``layers.*.attn.q_proj`` matches ``layers.3.attn.q_proj``: globs
    match one dotted segment each, as in torch's ``parallelize_module``
    (so ``*`` never swallows a whole subtree)."""
    ps, fs = pattern.split("."), fqn.split(".")
    return len(ps) == len(fs) and all(fnmatch.fnmatchcase(f, p) for p, f in zip(ps, fs))


def declared_tp_plan(model: nn.Module) -> dict[str, StyleSpec]:
    """The TP plan the model declares: ``_tp_plan`` (module-root-relative
    globs), or for a Hugging Face model its base and head plans together."""
    from ..hf import hf_tp_plan  # reads attributes only; never imports transformers

    own = model.__dict__.get("_tp_plan", getattr(type(model), "_tp_plan", None))
    if own is None:
        found: dict[str, StyleSpec] = {}
        found.update(hf_tp_plan(model))  # a wrapper around Hugging Face models: their plans, prefixed
        return found
    if not isinstance(own, Mapping):
        raise TypeError(f"{type(model).__name__}._tp_plan must be a mapping of module glob -> style, got {type(own).__name__}")
    return dict(own)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def tensor_parallel(
    model: nn.Module,
    current: Plan,
    /,
    *,
    plan: Mapping[str, StyleSpec] | None = None,
    sequence_parallel: bool = False,
) -> Plan:
    """Record which module gets which tensor-parallel style.

    ``plan`` maps module globs (one segment per ``*``) to a torch
    ``ParallelStyle`` or a Hugging Face style name (``colwise``, ``rowwise``,
    ``colwise_rep``, ``rowwise_rep``, ``embedding_rowwise``,
    ``sequence_parallel``, ``replicated_with_grad_allreduce``); by default the
    model's declared plan (``_tp_plan``, or Hugging Face's
    ``base_model_tp_plan`` with the head's). Every glob of an explicit plan
    must match a module; a declared plan's entries that match no module or
    name a style torch has no equivalent for are skipped, and the Plan shows
    them. A module may be matched by one glob only. An empty plan is valid:
    every parameter is then a replica on each TP rank, kept equal by
    :func:`fsdptx.synchronize_tp_replica_gradients`.

    ``sequence_parallel=True`` derives the sequence-parallel layout: rowwise
    outputs are reduce-scattered onto the sequence dim; inside a block, the
    parents of colwise projections gather the sequence once at their
    boundary (a ``colwise_rep`` projection there then takes it replicated,
    as in the plain layout); a plan that tensor-parallelizes no block stack
    is refused, since nothing would shard the sequence; the
    norms of each block and of the backbone run on the local sequence shard
    (``SequenceParallel``); the first block of each TP stack keeps its
    rank's slice of the sequence (embeddings return it whole: models derive
    positions from its length), and an output head outside the plan gathers
    it.
    Plain parameters left on the sequence-sharded stream of a block (a
    holder added to the residual, a gate) get a ``sum`` TP-replica mark:
    each TP rank's gradient covers only its tokens.
    """
    from ..planning._transforms import model_index  # local: _transforms re-exports this transform

    index = model_index(model, current)
    explicit = plan is not None
    declared = dict(plan) if plan is not None else declared_tp_plan(model)
    assigned: dict[str, TPAssignment] = {}
    skipped: list[tuple[str, str, str]] = []
    reductions: dict[str, Reduction] = dict(current.reductions)
    problems: list[str] = []
    for pattern, spec in declared.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tensor_parallel: plan keys must be module globs (str), got {pattern!r}")
        if not isinstance(spec, (str, ParallelStyle)):
            raise TypeError(
                f"tensor_parallel: style for {pattern!r} must be a torch ParallelStyle or one of "
                f"{', '.join(STYLE_NAMES)}, got {type(spec).__name__}"
            )
        if isinstance(spec, str) and spec in UNSUPPORTED_STYLES and not explicit:
            skipped.append((pattern, spec, "no torch equivalent: left whole on every TP rank"))
            continue
        if isinstance(spec, str) and spec not in STYLE_NAMES:
            problems.append(f"{pattern!r}: unknown style {spec!r}; use one of {', '.join(STYLE_NAMES)} or a torch ParallelStyle")
            continue
        matched = [f for f in index.modules if f and segment_match(pattern, f)]
        if not matched:
            if explicit:
                problems.append(f"{pattern!r} matches no module of {type(model).__name__}")
            else:  # Hugging Face plans also name parameters and layers a config may not build
                skipped.append((pattern, spec if isinstance(spec, str) else describe_style(spec), "matches no module"))
            continue
        if isinstance(spec, str) and spec in REPLICA_SUM_STYLES:
            for fqn in matched:
                _mark_sum(index, fqn, reductions, pattern, problems)
            skipped.append((pattern, spec, "its gradients are summed over TP ranks (TP-replica mark)"))
            continue
        if spec == "sequence_parallel" and not sequence_parallel:
            skipped.append((pattern, spec, "applies only with sequence_parallel=True"))
            continue
        for fqn in matched:
            if fqn in assigned:
                problems.append(f"module {fqn!r} is matched by both {assigned[fqn].pattern!r} and {pattern!r}")
                continue
            module = index.modules[fqn]
            if isinstance(spec, str):
                style = style_for(spec, module, sequence_parallel)
                name = spec
            else:
                style, name = spec, describe_style(spec)
            assigned[fqn] = TPAssignment(fqn, name, pattern, style)
    if problems:
        raise PlanningError("tensor_parallel: the TP plan does not fit the model:\n  - " + "\n  - ".join(problems))
    if sequence_parallel:
        stacks = _tp_stacks(index, assigned)
        if not stacks:
            # Without a TP block stack nothing shards the sequence, yet the
            # head's sequence-parallel style would read its whole-sequence
            # input as one rank's slice: logits for twice the tokens.
            raise PlanningError(
                "tensor_parallel: sequence_parallel=True, but the TP plan parallelizes no block stack "
                f"(it covers {preview(sorted(assigned)) or 'no module'}), so no block would run on a "
                "sequence shard; use sequence_parallel=False, or a TP plan that shards the blocks' projections"
            )
        _add_sequence_boundaries(model, index, assigned, stacks)
        for fqn in _on_sequence_shard(index, assigned, stacks):
            _mark_sum(index, fqn, reductions, "<sequence parallel>", problems)
        if problems:
            raise PlanningError("tensor_parallel: " + "; ".join(problems))
    tp = TensorParallel(
        assignments=tuple(assigned[f] for f in sorted(assigned)),
        sequence_parallel=sequence_parallel,
        skipped=tuple(skipped),
    )
    return current.replace(tensor_parallel=tp, reductions=reductions)


def _mark_sum(index: ModelIndex, fqn: str, out: dict[str, Reduction], pattern: str, problems: list[str]) -> None:
    params = [p for p in index.modules[fqn]._parameters.values() if p is not None]
    if not params:
        problems.append(f"{pattern!r} matches {fqn!r}, which holds no parameter to reduce")
    for p in params:
        name = index.param_fqn[id(p)]
        if out.get(name, "sum") != "sum":
            problems.append(f"parameter {name!r} is marked {out[name]!r} and, by {pattern!r}, 'sum'")
        out[name] = "sum"


def _tp_stacks(index: ModelIndex, assigned: dict[str, TPAssignment]) -> dict[str, list[str]]:
    """The block stacks the declared plan tensor-parallelizes: parent
    container -> its blocks in order. Sequence parallelism applies to these
    only; a stack without TP (a vision tower beside the language model)
    keeps its own layout."""
    stacks: dict[str, list[str]] = {}
    for b in index.blocks:
        stacks.setdefault(b.rpartition(".")[0], []).append(b)
    return {
        parent: blocks
        for parent, blocks in stacks.items()
        if any(f.startswith(b + ".") for b in blocks for f in assigned)
    }


# Colwise styles whose input, inside a block, is gathered once at the parent.
_GATHERED_AT_PARENT = frozenset({"colwise", "colwise_rep", "colwise_gather_output"})


def _add_sequence_boundaries(
    model: nn.Module, index: ModelIndex, assigned: dict[str, TPAssignment], stacks: dict[str, list[str]]
) -> None:
    """Styles that sequence parallelism needs where the declared plan says
    nothing: the first block of each TP stack keeps its slice of the
    sequence, parents of colwise projections gather it back, the norms of
    the blocks and of the backbone run on the local shard, and an output
    head outside the plan gathers the sequence."""
    blocks = {b for stack in stacks.values() for b in stack}
    backbones = {parent.rpartition(".")[0] for parent in stacks}
    for fqn in sorted(assigned):
        a = assigned[fqn]
        if not isinstance(a.parallel_style, ColwiseParallel) or a.style not in _GATHERED_AT_PARENT:
            continue
        parent = fqn.rpartition(".")[0]
        if parent in blocks or parent in backbones:
            continue
        if a.style != "colwise" and not any(fqn.startswith(b + ".") for b in blocks):
            continue  # a gathered projection outside the blocks (an output head) gathers for itself
        if parent not in assigned:
            assigned[parent] = TPAssignment(parent, "gather_sequence (sp)", "<sequence parallel>", GatherSequence())
        if a.style != "colwise" and isinstance(assigned[parent].parallel_style, GatherSequence):
            # Its input is the parent's gathered sequence, not a shard: the
            # plain layout (Olmo2's and Phi3's q/k/v projections). Under a
            # parent with a style of the plan's own, it gathers for itself.
            assigned[fqn] = TPAssignment(fqn, a.style, a.pattern, style_for(a.style, index.modules[fqn], False))
    for fqn, module in index.modules.items():
        parent = fqn.rpartition(".")[0]
        if fqn and fqn not in assigned and _is_norm(module) and (parent in blocks or parent in backbones):
            if any(p is not None for p in module._parameters.values()):
                assigned[fqn] = TPAssignment(fqn, "sequence_parallel (sp)", "<sequence parallel>", style_for("sequence_parallel", module, True))
    for stack in stacks.values():
        first = stack[0]
        if first not in assigned:
            assigned[first] = TPAssignment(first, "shard_sequence (sp)", "<sequence parallel>", ShardSequence())
    head = _output_head(model, index)
    if head is not None and head not in assigned:
        # A plain module: it gets the gathered sequence as a plain tensor.
        gather = PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True)
        assigned[head] = TPAssignment(head, "gather_sequence_input (sp)", "<sequence parallel>", gather)


def _on_sequence_shard(index: ModelIndex, assigned: dict[str, TPAssignment], stacks: dict[str, list[str]]) -> list[str]:
    """Modules with plain parameters that run on the sequence-sharded stream.

    Under sequence parallelism the residual stream between TP regions holds
    each rank's slice of the tokens. A module there that no TP style covers
    (a per-block holder added to the stream, a gate, a router) keeps a full
    replica of its parameters but sees only its rank's tokens, so its
    gradient on each TP rank is a partial sum over disjoint tokens: the
    reduction that math requires is ``sum``. Modules inside a TP region
    (under a gathering parent or a sharded projection) are not on the
    stream, and neither is anything outside the TP stacks' blocks.
    """
    blocks = [b for stack in stacks.values() for b in stack]
    found = []
    for fqn, module in index.modules.items():
        if fqn in assigned or not any(p is not None for p in module._parameters.values()):
            continue
        block = next((b for b in blocks if fqn.startswith(b + ".")), None)
        if block is None:
            continue
        parts = fqn[len(block) + 1 :].split(".")
        covered = any(f"{block}.{'.'.join(parts[: i + 1])}" in assigned for i in range(len(parts) - 1))
        if not covered:
            found.append(fqn)
    return found


def _output_head(model: nn.Module, index: ModelIndex) -> str | None:
    """The FQN of the output head (see :func:`_head_module`)."""
    head = _head_module(model, index.modules)
    return None if head is None else index.fqn_of_module.get(id(head))


def _head_module(model: nn.Module, modules: Mapping[str, nn.Module]) -> nn.Module | None:
    """The output head: what a Hugging Face model's
    ``get_output_embeddings`` returns, else a root ``lm_head`` Linear."""
    fn = getattr(model, "get_output_embeddings", None)
    if callable(fn):
        try:
            found = fn()
        except (NotImplementedError, AttributeError):
            found = None
        if isinstance(found, nn.Module):
            return found
    lm_head = modules.get("lm_head")
    return lm_head if isinstance(lm_head, nn.Linear) else None


_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def check_tensor_parallel(tp: TensorParallel, model: nn.Module, tp_size: int) -> list[str]:
    """Problems that make the TP plan unappliable at ``tp_size``: a torch
    colwise/rowwise style on a module it cannot shard, a sharded dim or a
    declared head count not divisible by the TP size, a module that no
    longer exists. Pure; empty when it fits."""
    problems: list[str] = []
    modules = dict(model.named_modules())
    for a in tp.assignments:
        module = modules.get(a.module)
        if module is None:
            problems.append(f"TP module {a.module!r} does not exist in {type(model).__name__}")
            continue
        style = a.parallel_style
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            continue
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            problems.append(
                f"{a.module!r} ({type(module).__name__}) gets {a.style}, which torch applies only to "
                "nn.Linear and nn.Embedding; give it another style or leave it out of the TP plan"
            )
            continue
        dim, what = _sharded_dim(module, isinstance(style, ColwiseParallel))
        if dim % tp_size:
            problems.append(f"{a.module!r}: {what}={dim} is not divisible by tp={tp_size} ({a.style})")
    problems.extend(tied_tp_groups(tp, model)[1])
    # Head counts matter where attention is sharded, which a plan sharding
    # no Linear but the output head (GPT-OSS's: embedding and head) does not
    # do; any other sharded Linear is taken to be in a block, heads and all.
    head = _head_module(model, modules)
    splits_blocks = any(
        isinstance(a.parallel_style, (ColwiseParallel, RowwiseParallel))
        and isinstance(modules.get(a.module), nn.Linear)
        and modules.get(a.module) is not head
        for a in tp.assignments
    )
    config = getattr(model, "config", None) if splits_blocks else None
    for cfg in (config, getattr(config, "text_config", None)):
        for key in _HEAD_COUNTS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and value % tp_size:
                problems.append(f"config.{key}={value} is not divisible by tp={tp_size}")
    return problems


def _weight_layout(module: nn.Module, a: TPAssignment | None) -> str:
    """Where a torch style puts ``module.weight``: colwise shards the output
    dim of a Linear (dim 0) and the embedding dim of an Embedding (dim 1);
    rowwise the input dim of a Linear (dim 1) and the vocabulary (dim 0)."""
    if a is None or not isinstance(a.parallel_style, (ColwiseParallel, RowwiseParallel)):
        return "replicated" if a is None or not isinstance(a.parallel_style, SequenceParallel) else "replicated (DTensor)"
    colwise = isinstance(a.parallel_style, ColwiseParallel)
    if isinstance(module, nn.Embedding):
        return "Shard(1)" if colwise else "Shard(0)"
    return "Shard(0)" if colwise else "Shard(1)"


def tied_tp_groups(tp: TensorParallel, model: nn.Module) -> tuple[list[list[tuple[str, str]]], list[str]]:
    """Tied weights whose modules get TP styles: groups of (module FQN,
    parameter name) sharing one parameter, and the problems of those whose
    styles would shard it differently (they cannot stay tied).

    ``parallelize_module`` replaces each module's parameters with new
    DTensors, which unties a weight shared by two modules (Hugging Face's
    tied embedding and LM head); ``apply_plan`` ties them again afterwards
    when both halves are sharded the same way."""
    by_module = {a.module: a for a in tp.assignments}
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((fqn, name, module))
    groups: list[list[tuple[str, str]]] = []
    problems: list[str] = []
    for found in owners.values():
        unique = list(dict.fromkeys((f, n) for f, n, _m in found))
        if len(unique) < 2 or not any(f in by_module for f, _n in unique):
            continue
        layouts = {f"{f}.{n}": _weight_layout(m, by_module.get(f)) for f, n, m in found}
        if len(set(layouts.values())) > 1:
            problems.append(
                "tied parameter " + " = ".join(layouts) + " would be sharded differently ("
                + ", ".join(f"{k}: {v}" for k, v in layouts.items())
                + "); give both modules styles that shard it alike, or untie it"
            )
        else:
            groups.append(unique)
    return groups, problems


def _sharded_dim(module: nn.Module, colwise: bool) -> tuple[int, str]:
    if isinstance(module, nn.Embedding):
        # Colwise shards the embedding dim; rowwise the vocabulary.
        return (module.embedding_dim, "embedding_dim") if colwise else (module.num_embeddings, "num_embeddings")
    assert isinstance(module, nn.Linear)
    return (module.out_features, "out_features") if colwise else (module.in_features, "in_features")


def tp_styles_by_module(tp: TensorParallel) -> dict[str, Any]:
    """The dict ``parallelize_module`` takes: concrete FQN -> torch style."""
    return {a.module: a.parallel_style for a in tp.assignments}

