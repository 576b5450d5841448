"""The ``tensor_parallel`` transform and the checks a TP plan must pass.

Patterns are resolved to concrete module FQNs when planning, so the Plan says
exactly which module gets which torch style, and ``apply_plan`` hands torch's
``parallelize_module`` one dict of concrete names. The checks that need the
TP size (divisibility) are a separate pure function, run by ``apply_plan``
and by the manager's dry run before anything is mutated.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from ..core._globs import segment_match
from ..model._stages import STAGE_ATTRIBUTE
from ..core._args import require_bool
from ..core._names import Names, name_tokens
from ..model._index import ModelIndex, PlanningError, empty_containers_note
from ..plan._kinds import unit_blind
from ..plan._compose import check_transform_args, model_index
from ..plan.transforms import block_fqns
from ..plan._plan import Plan
from ..plan._types import Reduction, TensorParallel, TPAssignment, preview
from ._experts import EXPERT_PARAM_STYLES, EXPERTS_STYLE, ExpertsParallel, expert_split_dim
from ._layout import StyleSpec, sequence_layout
from ._stream import output_head_module
from ._styles import REPLICA_SUM_STYLES, STYLE_NAMES, UNSUPPORTED_STYLES, describe_style, experts_pairing_problems

__all__ = ["check_tensor_parallel", "declared_tp_plan", "segment_match", "tensor_parallel", "without_tensor_parallel"]

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


@unit_blind
def tensor_parallel(
    model: nn.Module,
    current: Plan,
    /,
    *,
    plan: Mapping[str, StyleSpec] | None = None,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    blocks: Names | None = None,
    moe_mesh_experts: Sequence[str] = (),
) -> Plan:
    """Record which module gets which tensor-parallel style.

    ``plan`` maps module globs (one segment per ``*``; activation-checkpoint
    and ``torch.compile`` wrappers are seen through, so ``layers.*.attn.q_proj``
    matches a wrapped block's projection) to a torch ``ParallelStyle`` or a
    Hugging Face style name (``colwise``, ``rowwise``, ``colwise_rep``,
    ``rowwise_rep``, ``embedding_rowwise``, ``sequence_parallel``,
    ``replicated_with_grad_allreduce``, and ``moe_tp_experts`` on a
    grouped-experts module with ``packed_colwise``/``colwise``/``rowwise``
    on its 3-D parameters, see :mod:`fsdptx.tp._experts`); by default the
    model's declared plan (``_tp_plan``, or Hugging Face's
    ``base_model_tp_plan`` with the head's). Every glob of an explicit plan
    must match a module; a declared plan's entries that match no module or
    name a style fsdptx does not apply are skipped, and the Plan shows them
    (with a warning on its first lines where modules keep whole weights). A module may be
    matched by one glob only. An empty plan is valid without sequence
    parallelism: every parameter is then a replica on each TP rank, kept
    equal by :func:`fsdptx.synchronize_tp_replica_gradients`. With
    ``sequence_parallel=True`` a plan that splits no module (empty, or only
    ``sequence_parallel`` norms) is refused: the sequence would be sliced
    only to be gathered back, with nothing tensor-parallel.

    Layouts come from the sequence-layout pass (:mod:`fsdptx.tp._layout`):
    a style name is built for the layout its position on the residual
    stream takes and gives; torch styles are used as given and checked
    against their neighbours. ``sequence_parallel=True`` runs the blocks on
    the ``Shard(1)`` sequence shard, adding only the boundaries the plan
    leaves out; a plan whose layouts disagree is refused naming both
    modules. ``loss_parallel=True`` keeps the head's logits
    vocabulary-sharded (compute the loss under :func:`fsdptx.loss_parallel`).
    ``blocks`` as in :func:`fsdptx.shard_by_dtype`.

    ``moe_mesh_experts`` (globs) are expert modules whose FSDP units shard
    over a separate MoE mesh (the manager passes them when it has a
    ``moe_mesh``): FSDP cannot lay such a unit over a TP DTensor of another
    mesh, so their ``moe_tp_experts`` entries keep them whole on every TP
    rank (skipped and said in the Plan under a declared plan, an error in
    an explicit one).

    Args:
        model: the model, only read.
        current: the Plan so far (positional only: the transform protocol).
        plan: module glob -> style name or torch ``ParallelStyle``; the
            model's declared plan when ``None``.
        sequence_parallel: run the blocks on the sequence shard.
        loss_parallel: keep the head's logits vocabulary-sharded.
        blocks: class names, FQNs or globs of the blocks; discovered when
            ``None``.
        moe_mesh_experts: globs of expert modules sharded over a MoE mesh,
            kept whole on every TP rank.

    Returns:
        A new Plan recording one style per module and the stream's layout.

    Raises:
        TypeError: a key is not a str or a value not a style.
        PlanningError: a glob matches no module, a module is matched twice,
            a style name is unknown, the layouts disagree, or
            ``sequence_parallel=True`` with a plan that splits no module.

    Example::

        sp = functools.partial(fsdptx.tensor_parallel, sequence_parallel=True)
        print(fsdptx.plan(model, sp))   # the stream's layout at each module
    """
    where = "tensor_parallel"
    check_transform_args(model, current, where, "current")
    if plan is not None and not isinstance(plan, Mapping):
        raise TypeError(f"{where}: plan must be a mapping of module glob -> style, or None, got {type(plan).__name__}")
    require_bool(sequence_parallel, "sequence_parallel", where)
    require_bool(loss_parallel, "loss_parallel", where)
    moe_mesh_experts = name_tokens(moe_mesh_experts, "moe_mesh_experts", where)
    index = model_index(model, current)
    explicit = plan is not None
    declared = dict(plan) if plan is not None else declared_tp_plan(model)
    resolved: dict[str, tuple[str, StyleSpec]] = {}
    skipped: list[tuple[str, str, str]] = []
    reductions: dict[str, Reduction] = dict(current.reductions)
    problems: list[str] = []
    sum_modules: list[str] = []
    warnings: list[str] = []
    for pattern, spec in declared.items():
        if not isinstance(pattern, str):
            raise TypeError(f"tensor_parallel: plan keys must be module globs (str), got {pattern!r}")
        if not isinstance(spec, (str, ParallelStyle)):
            raise TypeError(
                f"tensor_parallel: style for {pattern!r} must be a torch ParallelStyle or one of "
                f"{', '.join((*STYLE_NAMES, EXPERTS_STYLE))}, got {type(spec).__name__}"
            )
    # On a pipeline stage, entries naming another stage's modules match nothing here.
    staged = getattr(model, STAGE_ATTRIBUTE, None) is not None
    on_moe_mesh = {f for g in moe_mesh_experts for f in index.match(g)}
    experts, consumed = _expert_styles(index, declared, explicit, on_moe_mesh, problems, skipped, warnings)
    for pattern, spec in declared.items():
        if pattern in consumed:
            continue
        if isinstance(spec, str) and spec in UNSUPPORTED_STYLES and not explicit:
            skipped.append((pattern, spec, "no torch equivalent: left whole on every TP rank"))
            if index.match(pattern):
                warnings.append(
                    f"tensor_parallel: the declared TP plan gives {pattern!r} the style {spec!r}, which fsdptx "
                    "cannot apply: its weights stay whole on every TP rank (give it a torch style in tp_plan=)"
                )
            continue
        if isinstance(spec, str) and spec not in STYLE_NAMES:
            problems.append(f"{pattern!r}: unknown style {spec!r}; use one of {', '.join(STYLE_NAMES)} or a torch ParallelStyle")
            continue
        matched = index.match(pattern)
        if not matched:
            if explicit and not staged:
                problems.append(f"{pattern!r} matches no module of {type(model).__name__}")
            else:  # Hugging Face plans also name parameters and layers a config may not build
                why = "matches no module of this pipeline stage" if staged else "matches no module"
                skipped.append((pattern, spec if isinstance(spec, str) else describe_style(spec), why))
            continue
        if isinstance(spec, str) and spec in REPLICA_SUM_STYLES:
            for fqn in matched:
                _mark_sum(index, fqn, reductions, pattern, problems)
            sum_modules.extend(matched)
            skipped.append((pattern, spec, "its gradients are summed over TP ranks (TP-replica mark)"))
            continue
        if spec == "sequence_parallel" and not sequence_parallel:
            skipped.append((pattern, spec, "applies only with sequence_parallel=True"))
            continue
        for fqn in matched:
            if fqn in resolved:
                problems.append(f"module {fqn!r} is matched by both {resolved[fqn][0]!r} and {pattern!r}")
                continue
            if isinstance(spec, ExpertsParallel):
                problems.extend(_expert_problems(fqn, index.modules[fqn], spec.params))
            resolved[fqn] = (pattern, spec)
    for fqn, (pattern, style) in experts.items():
        if fqn in resolved:
            problems.append(f"module {fqn!r} is matched by both {resolved[fqn][0]!r} and {pattern!r}")
        resolved[fqn] = (pattern, style)
    if problems:
        raise PlanningError("tensor_parallel: the TP plan does not fit the model:\n  - " + "\n  - ".join(problems))
    targets = block_fqns(blocks, index, "tensor_parallel")
    if sequence_parallel and not targets:
        raise PlanningError(
            f"tensor_parallel: sequence_parallel=True, but no blocks were found in {type(model).__name__} to "
            f"run on the sequence shard{empty_containers_note(index)}; name them with FSDP2Config(blocks=...) "
            "or tensor_parallel(blocks=...), or declare _no_split_modules"
        )
    layout = sequence_layout(
        model,
        index,
        resolved,
        targets,
        sum_marked=sum_modules,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
    )
    for fqn in layout.sums:
        _mark_sum(index, fqn, reductions, "<sequence parallel>", layout.problems)
    if layout.problems:
        raise PlanningError(
            "tensor_parallel: the TP plan's sequence layouts disagree:\n  - " + "\n  - ".join(layout.problems)
        )
    if sequence_parallel and not any(not _only_sequence_parallel(spec) for _pattern, spec in resolved.values()):
        if explicit:
            given = f"tp_plan={dict(declared)!r}"
        elif declared:
            given = f"none of the entries {type(model).__name__} declares is one fsdptx applies: {sorted(declared)!r}"
        else:
            given = f"{type(model).__name__} declares no TP plan"
        raise PlanningError(
            f"tensor_parallel: sequence_parallel=True, but the TP plan splits no module over the TP ranks "
            f"({given}): the sequence would be sliced only to be gathered back around every sublayer, "
            "with nothing tensor-parallel; give TP styles (tp_plan=, or the model's declared plan), "
            "or set sequence_parallel=False"
        )
    assigned = layout.assignments
    tp = TensorParallel(
        assignments=tuple(assigned[f] for f in sorted(assigned)),
        sequence_parallel=sequence_parallel,
        skipped=tuple(skipped),
        loss_parallel=loss_parallel,
        stream=tuple(layout.steps),
    )
    new_warnings = tuple(w for w in dict.fromkeys(warnings) if w not in current.warnings)
    return current.replace(tensor_parallel=tp, reductions=reductions, warnings=current.warnings + new_warnings)


@unit_blind
def without_tensor_parallel(
    model: nn.Module, current: Plan, /, *, sequence_parallel: bool = False, loss_parallel: bool = False
) -> Plan:
    """What a pipeline plans in place of :func:`tensor_parallel` on a mesh
    without a ``tp`` dim of size > 1: no TP, and a warning on the Plan's
    first lines for each option that needs TP and so has no effect.

    Not an error: every rank then runs the whole sequence and computes the
    whole logits, which is correct (a loss computed under
    :func:`fsdptx.loss_parallel` on plain logits is the ordinary one), and
    one config may serve meshes with and without TP. But a reader who asked
    for sequence or loss parallelism must see that they got neither.

    Args:
        model: the model, only read (unused).
        current: the Plan so far (positional only: the transform protocol).
        sequence_parallel: whether sequence parallelism was asked for.
        loss_parallel: whether loss parallelism was asked for.

    Returns:
        ``current`` with the warnings added (once each).
    """
    del model
    found = []
    if sequence_parallel:
        found.append(
            "sequence_parallel=True has no effect: the mesh has no tp dim of size > 1, so every rank runs the "
            "whole sequence (add a tp dim, or drop the option)"
        )
    if loss_parallel:
        found.append(
            "loss_parallel=True has no effect: the mesh has no tp dim of size > 1, so the logits stay whole plain "
            "tensors (a loss under fsdptx.loss_parallel() is the ordinary one; add a tp dim, or drop the option)"
        )
    new = tuple(w for w in found if w not in current.warnings)
    return current.replace(warnings=current.warnings + new) if new else current


def _only_sequence_parallel(spec: StyleSpec) -> bool:
    """Whether a style only runs a norm on the sequence shard (it splits no
    weight over the TP ranks)."""
    return spec == "sequence_parallel" or isinstance(spec, SequenceParallel)


def _expert_styles(
    index: ModelIndex,
    declared: Mapping[str, StyleSpec],
    explicit: bool,
    on_moe_mesh: Collection[str],
    problems: list[str],
    skipped: list[tuple[str, str, str]],
    warnings: list[str],
) -> tuple[dict[str, tuple[str, ExpertsParallel]], set[str]]:
    """The :class:`ExpertsParallel` style of every module a ``moe_tp_experts``
    entry names, built from the entries naming its parameters
    (``<experts glob>.gate_up_proj: packed_colwise``, ``...down_proj:
    rowwise``), and the patterns these entries consumed.

    Every parameter of the module must be split, and split the way an
    ``(experts, out, in)`` weight can be: a parameter left whole beside
    split ones (an expert bias the plan forgets) would be added to partial
    outputs on every rank and summed ``tp`` times. A module that does not
    fit is an error under an explicit plan; under a declared one it is left
    whole on every TP rank, which is correct, and the Plan's first lines say so.
    """
    out: dict[str, tuple[str, ExpertsParallel]] = {}
    consumed: set[str] = set()
    for pattern, spec in declared.items():
        if spec != EXPERTS_STYLE:
            continue
        consumed.add(pattern)
        entries = {
            k[len(pattern) + 1 :]: v
            for k, v in declared.items()
            if k.startswith(pattern + ".") and "." not in k[len(pattern) + 1 :] and isinstance(v, str)
        }
        consumed.update(f"{pattern}.{name}" for name in entries)
        matched = index.match(pattern)
        if not matched:
            if explicit and getattr(index.root, STAGE_ATTRIBUTE, None) is None:
                problems.append(f"{pattern!r} matches no module")
            else:
                skipped.append((pattern, EXPERTS_STYLE, "matches no module"))
            continue
        kept = [f for f in matched if f in on_moe_mesh]
        if kept and explicit:
            problems.append(
                f"{pattern!r} splits {preview(kept)} over TP, but they shard over the moe_mesh; "
                "leave them out of the TP plan, or give no moe_mesh"
            )
            continue
        if kept:
            skipped.append((pattern, EXPERTS_STYLE, "shards over the moe_mesh: left whole on every TP rank"))
            matched = [f for f in matched if f not in on_moe_mesh]
        for fqn in matched:
            found = _expert_problems(fqn, index.modules[fqn], entries)
            if not found:
                out[fqn] = (pattern, ExpertsParallel(entries))
            elif explicit:
                problems.extend(found)
            else:
                skipped.append((pattern, EXPERTS_STYLE, "cannot be split: left whole on every TP rank"))
                warnings.append(
                    f"tensor_parallel: the declared TP plan's experts {pattern!r} stay whole on every TP rank: "
                    + "; ".join(found)
                )
                break
    return out, consumed


def _expert_problems(fqn: str, module: nn.Module, entries: Mapping[str, str]) -> list[str]:
    """Why ``moe_tp_experts`` with parameter styles ``entries`` cannot split
    ``module`` (empty when it can)."""
    problems: list[str] = []
    own = {n: p for n, p in module._parameters.items() if p is not None}
    for name, style in entries.items():
        p = own.get(name)
        if p is None:
            problems.append(f"{fqn!r} has no parameter {name!r} for the plan's {style!r} entry")
        elif style not in EXPERT_PARAM_STYLES or p.dim() != 3:
            problems.append(
                f"{fqn}.{name} ({p.dim()}-D) gets {style!r}; an expert weight is 3-D (experts, out, in) and "
                f"takes one of {', '.join(sorted(EXPERT_PARAM_STYLES))}"
            )
    whole = sorted(set(own) - set(entries))
    if whole:
        problems.append(
            f"{fqn!r} ({EXPERTS_STYLE}) holds {', '.join(repr(n) for n in whole)}, which the plan does not split; "
            "each rank would add it to its partial output; give each a style "
            f"({', '.join(sorted(EXPERT_PARAM_STYLES))})"
        )
    if not entries:
        problems.append(
            f"{fqn!r} ({EXPERTS_STYLE}): the plan names none of its parameters "
            f"(give '{fqn}.gate_up_proj: packed_colwise' and the like)"
        )
    inner = [n for n, c in module.named_modules() if n and any(True for _ in c.parameters(recurse=False))]
    if inner:
        problems.append(
            f"{fqn!r} ({EXPERTS_STYLE}) has submodules holding parameters ({', '.join(inner)}); "
            "the style splits the module's own 3-D parameters only"
        )
    return problems


def _mark_sum(index: ModelIndex, fqn: str, out: dict[str, Reduction], pattern: str, problems: list[str]) -> None:
    params = [p for p in index.modules[fqn]._parameters.values() if p is not None]
    if not params:
        problems.append(f"{pattern!r} matches {fqn!r}, which holds no parameter to reduce")
    for p in params:
        name = index.param_fqn[id(p)]
        if out.get(name, "sum") != "sum":
            problems.append(f"parameter {name!r} is marked {out[name]!r} and, by {pattern!r}, 'sum'")
        out[name] = "sum"


_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def check_tensor_parallel(
    tp: TensorParallel, model: nn.Module, tp_size: int, *, index: ModelIndex | None = None
) -> list[str]:
    """Problems that make the TP plan unappliable at ``tp_size``: a torch
    colwise/rowwise style on a module it cannot shard, a sharded dim or a
    declared head count not divisible by the TP size, a module that no
    longer exists, experts styles that do not pair up (a plan file edited
    by hand). Pure; empty when it fits. ``index``: the model's index
    as it is now, read instead of walking the model again."""
    problems: list[str] = experts_pairing_problems({a.module: a.parallel_style for a in tp.assignments})
    modules = index.modules if index is not None else dict(model.named_modules())
    for a in tp.assignments:
        module = modules.get(a.module)
        if module is None:
            problems.append(f"TP module {a.module!r} does not exist in {type(model).__name__}")
            continue
        style = a.parallel_style
        if isinstance(style, ExpertsParallel):
            for name, param_style in style.params.items():
                p = module._parameters.get(name)
                if p is None or p.dim() != 3:
                    problems.append(f"{a.module!r} no longer holds the 3-D parameter {name!r} its {a.style} splits")
                    continue
                size, what = expert_split_dim(param_style, tuple(p.shape))
                if size % tp_size:
                    problems.append(f"{a.module}.{name}: {what}={size} is not divisible by tp={tp_size} ({param_style})")
            continue
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
    problems.extend(tied_tp_groups(tp, model, index=index)[1])
    # Head counts matter where attention is sharded, which a plan sharding
    # no Linear but the output head (GPT-OSS's: embedding and head) does not
    # do; any other sharded Linear is taken to be in a block, heads and all.
    head = output_head_module(model, modules)
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


def tied_tp_groups(
    tp: TensorParallel, model: nn.Module, *, index: ModelIndex | None = None
) -> tuple[list[list[tuple[str, str]]], list[str]]:
    """Tied weights whose modules get TP styles: groups of (module FQN,
    parameter name) sharing one parameter, and the problems of those whose
    styles would shard it differently (they cannot stay tied).

    ``parallelize_module`` replaces each module's parameters with new
    DTensors, which unties a weight shared by two modules (Hugging Face's
    tied embedding and LM head); ``apply_plan`` ties them again afterwards
    when both halves are sharded the same way. ``index``: the model's index
    as it is now, whose parameter slots are read instead of walking the
    model again (unless some module is shared: its every path counts)."""
    by_module = {a.module: a for a in tp.assignments}
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    if index is not None and not index.shared_modules:
        walk, fqns = index.walk, index.module_fqns
        if index.tied:
            for owner, name, p in zip(walk.owners, walk.slot_names, walk.params):
                owners.setdefault(id(p), []).append((fqns[owner], name, walk.modules[owner]))
    else:
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

