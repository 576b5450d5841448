"""Read the parallelism declarations a Hugging Face model carries.

Pure readers: they accept any ``nn.Module``, never import ``transformers`` and
never mutate the model. A model without a declaration yields an empty result.

Facts about ``transformers`` 5.24 these readers rely on:

* **TP plans.** The config class holds ``base_model_tp_plan`` (and
  ``base_model_ep_plan``, ``base_model_pp_plan``) relative to the *base model*
  (``layers.*.self_attn.q_proj``). The head class holds ``_tp_plan`` relative
  to itself (``{"lm_head": "colwise_gather_output"}``). ``post_init`` calls
  ``init_parallel_plans``, which copies the class plan onto the instance, lets
  the base model add its config plan (plus ``embed_tokens:
  embedding_rowwise`` when a plan exists and ``embed_tokens`` is an
  ``nn.Embedding``), then prefixes every child's merged plan with the child's
  name. Children are built (and post-inited) first, so the root instance's
  ``_tp_plan`` is the whole, root-relative plan (``model.layers.*.…``).
  ``*`` stands for one layer index. Expert-parallel rules live apart in
  ``_ep_plan``, merged the same way.
* **Fp32 keeps.** ``_keep_in_fp32_modules`` upcasts matching weights to fp32
  only when loading in fp16; ``_keep_in_fp32_modules_strict`` upcasts them
  when loading in fp16 or bf16. Both are class attributes on the model,
  merged from children into instance sets by ``post_init``. Loading matches
  each token as a regex *search* over the parameter name (``*`` → ``.*``).
* **Tied weights.** ``_tied_weights_keys`` is a dict target → source
  (``{"lm_head.weight": "model.embed_tokens.weight"}``), possibly with regex
  keys; ``get_expanded_tied_weights_keys(all_submodels=True)`` expands it to
  root-relative parameter names and honours ``config.tie_word_embeddings``.
  Transformers 4.x used a list of target names with an implicit source.
* ``_no_split_modules``: class names of blocks that must stay whole (read by
  :func:`fsdptx.discover_blocks`).
* Packed sequences: ``transformers.modeling_flash_attention_utils.
  _is_packed_sequence(position_ids, batch_size)`` is looked up as a module
  global by ``_flash_attention_forward`` only, so patching that module
  attribute reaches every caller.

HF style names (``transformers.distributed.tensor_parallel``) and the torch
``parallelize_module`` style that does the same, where one exists:

==============================  ==============================================  ==========================================
style                           HF behaviour                                    torch equivalent
==============================  ==============================================  ==========================================
colwise                         weight/bias Shard(0); in Replicate, out         ColwiseParallel()
                                Shard(-1), local
colwise_gather_output,          as colwise, output all-gathered to Replicate    ColwiseParallel(output_layouts=Replicate())
colwise_rep
rowwise                         weight Shard(1), bias Replicate; in Shard(-1),  RowwiseParallel()
                                out Partial -> all-reduce Replicate, local
rowwise_split_input,            as rowwise, input Replicate sliced locally      RowwiseParallel(input_layouts=Replicate())
rowwise_rep
embedding_rowwise               vocab Shard(0), partial lookups all-reduced     RowwiseParallel(input_layouts=Replicate())
embedding_colwise               hidden Shard(1), slices gathered                ColwiseParallel(output_layouts=Replicate())
sequence_parallel               params Replicate DTensor, input Shard(1)        SequenceParallel()
all_reduce                      output Partial -> Replicate (sum)               PrepareModuleOutput(Partial -> Replicate)
replicated_with_grad_allreduce  plain replicated params, grads SUM all-reduced  none: fsdptx "sum" reduction mark
                                by a post-accumulate hook
packed_colwise                  fused gate|up, _StridedShard(split_factor=2)    none
packed_rowwise                  param only, _StridedShard(-1, split_factor=2)   none
moe_tp_experts                  local; input grads and routing-weight grads     none
                                SUM all-reduced, output SUM all-reduced
mla_kv_a_proj                   rope slice of the output: grad SUM all-reduced  none
moe_identity_expert             input divided by tp size                        none
local_params                    forward on the local shards of own params       none
replicate                       no-op: every rank keeps the full parameter      leave out of the plan
grouped_gemm (EP)               experts Shard(0) on the EP mesh                 none (expert parallelism)
ep_dispatch_experts (EP)        whole experts per rank, token dispatch          none (expert parallelism)
==============================  ==============================================  ==========================================

Dense-MLP rules of MoE models (``model.layers.*.mlp.gate_proj`` in Qwen3-MoE,
Qwen3-Next) match nothing unless ``mlp_only_layers`` is set: a consumer must
treat a rule that matches nothing as unused, as HF does (it warns).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

# One rule for names (a bare string is one name), shared with every layer.
from ..core._names import name_tokens as _names

__all__ = [
    "expert_modules_of",
    "hf_expert_modules",
    "hf_fp32_compute_tokens",
    "hf_replica_reductions",
    "hf_tied_weights",
    "hf_tp_plan",
]

# TP-plan style for a replicated module whose parameter gradient covers only the
# rank's local shard of the activations (Qwen3 q_norm/k_norm see only the rank's
# heads): HF all-reduces these gradients with SUM, so the replicas agree on the
# full gradient, which is the sum of the per-head contributions.
REPLICATED_SUM_STYLE = "replicated_with_grad_allreduce"
# Styles that mark a module as a group of experts: TP inside every expert, or
# whole experts per rank under expert parallelism.
EXPERT_STYLES = frozenset({"moe_tp_experts", "ep_dispatch_experts"})


def _checked_plan(plan: object, attribute: str, owner: str, shape: str) -> dict[str, str]:
    """``plan`` as a str -> str dict; ``shape`` names what keys and values mean."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"{owner}.{attribute} must be a mapping {shape}, got {type(plan).__name__}")
    for key, value in plan.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"{owner}.{attribute} maps {key!r} to {value!r}: both must be str ({shape})")
    return dict(plan)


def _merged_plan(model: nn.Module, attribute: str) -> dict[str, str]:
    """The root-relative plan in ``attribute`` (``_tp_plan`` or ``_ep_plan``).

    A module carrying the attribute already holds the merged plan of its
    subtree (HF's ``post_init``), so its subtree is not searched further; a
    wrapper without one (a plain container around an HF model) is looked
    through and the inner plan is prefixed with the inner model's FQN.
    """
    out: dict[str, str] = {}
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        fqn, module = stack.pop()
        # Instance dict, then class: a missing attribute through
        # nn.Module.__getattr__ raises, which would cost more than the walk.
        plan = module.__dict__.get(attribute, getattr(type(module), attribute, None))
        if plan is not None:
            prefix = fqn + "." if fqn else ""
            checked = _checked_plan(plan, attribute, type(module).__name__, "module glob -> style name")
            out.update({prefix + k: v for k, v in checked.items()})
            continue
        prefix = fqn + "." if fqn else ""
        stack.extend((prefix + n, c) for n, c in reversed(module._modules.items()) if c is not None)
    return out


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan: root-relative glob -> HF style name.

    Keys use HF's glob syntax (``*`` is one layer index) and name modules or,
    for bare parameters such as attention sinks, parameters. Expert-parallel
    rules are not included (see :func:`hf_expert_modules`).
    """
    return _merged_plan(model, "_tp_plan")


def hf_fp32_compute_tokens(model: nn.Module, compute_dtype: torch.dtype | None) -> tuple[str, ...]:
    """Name tokens whose parameters must compute in fp32 under ``compute_dtype``.

    ``_keep_in_fp32_modules_strict`` always counts: the model declares those
    weights intrinsically fp32, and under an fp32 (or disabled) policy the
    pin costs nothing. ``_keep_in_fp32_modules`` counts only for fp16
    compute, HF's rule (it guards against fp16 overflow, not bf16). Sorted,
    each token once: HF stores these as sets after ``post_init``.
    """
    tokens = set(_names(getattr(model, "_keep_in_fp32_modules_strict", None), "_keep_in_fp32_modules_strict"))
    if compute_dtype == torch.float16:
        tokens.update(_names(getattr(model, "_keep_in_fp32_modules", None), "_keep_in_fp32_modules"))
    return tuple(sorted(tokens))


def hf_tied_weights(model: nn.Module) -> dict[str, str]:
    """Tied parameters: alias FQN -> canonical (HF's source) FQN, root-relative.

    A ``PreTrainedModel`` expands its own declaration (regex keys, nested
    submodels, ``tie_word_embeddings``). Otherwise ``_tied_weights_keys`` is
    read: a dict is taken as target -> source; a list (the 4.x format) names
    targets only, whose source is the other name of the same parameter object.
    """
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    declared = expand(all_submodels=True) if callable(expand) else getattr(model, "_tied_weights_keys", None)
    if declared is None:
        return {}
    if isinstance(declared, Mapping):
        return _checked_plan(declared, "_tied_weights_keys", type(model).__name__, "alias -> source name")
    targets = _names(declared, "_tied_weights_keys")
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    out: dict[str, str] = {}
    for names in names_of.values():
        for target in targets:
            if target in names:
                others = [n for n in names if n not in targets]
                if others:
                    out[target] = min(others)
    return out


def hf_replica_reductions(model: nn.Module) -> dict[str, str]:
    """Module glob -> ``"sum"`` for TP-plan entries that stay replicated but
    whose parameter gradients are partial.

    ``replicated_with_grad_allreduce`` marks a norm applied after a colwise
    projection, per head (Qwen3 ``q_norm``/``k_norm``): every rank holds the
    full weight but normalizes only its local heads, so each rank's gradient
    is the contribution of its heads. The full gradient is the sum of those
    disjoint contributions (HF all-reduces with SUM); a mean would scale it
    by ``1 / tp_size``. Other replicated parameters see the whole activation
    on every rank, compute identical gradients, and need no mark (``"mean"``
    is the default).
    """
    return {glob: "sum" for glob, style in hf_tp_plan(model).items() if style == REPLICATED_SUM_STYLE}


def hf_expert_modules(model: nn.Module) -> tuple[str, ...]:
    """Globs of the modules holding a MoE layer's experts, sorted.

    Found from the plans: a TP rule ``moe_tp_experts`` or an EP rule
    ``ep_dispatch_experts`` names the experts module (Qwen3-MoE
    ``model.layers.*.mlp.experts``). Such modules are sharded on the expert
    mesh, not the dense one.
    """
    found = {g for g, style in hf_tp_plan(model).items() if style in EXPERT_STYLES}
    found.update(g for g, style in _merged_plan(model, "_ep_plan").items() if style in EXPERT_STYLES)
    return tuple(sorted(found))


def expert_modules_of(model: nn.Module) -> tuple[str, ...]:
    """Globs of ``model``'s expert modules as the manager finds them by
    default: the model's own ``_fsdptx_expert_modules``, else its
    transformers plans' (:func:`hf_expert_modules`)."""
    declared = getattr(model, "_fsdptx_expert_modules", None)
    return tuple(declared) if declared else hf_expert_modules(model)
