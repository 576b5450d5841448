"""The parameters one token's matmuls multiply: the ``N`` of ``--fit``'s 6N rule.

A dense model runs every token through every parameter that multiplies
(embedding tables aside: a lookup reads one row without FLOPs). A
mixture-of-experts layer does not: its router sends each token to
``top_k`` of its ``num_experts`` routed experts, so a token multiplies
``top_k / num_experts`` of the experts' parameters (DeepSeek-V3: 8 of 256,
about 37B of its 671B). Counting every expert would put an MoE model's
compute at 18 times what it runs and hide its communication behind that
compute in the predicted step time, which is what ranks the candidates.

Routed experts are the modules the manager splits across ``ep``: the
model's ``_fsdptx_expert_modules``, else its transformers plans'
(:func:`fsdptx.hf.hf_expert_modules`). ``num_experts`` is the module's own
attribute (transformers' fused experts modules carry it) and ``top_k`` the
model config's ``num_experts_per_tok``; without either, every expert
counts and the note says the compute is an upper bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core._globs import logical_fqn, segment_match

__all__ = ["ComputeParams", "compute_params"]

_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_top_k")
"""Config keys transformers' MoE models name ``top_k`` by."""


@dataclass(frozen=True)
class ComputeParams:
    """What one token's matmuls multiply.

    Attributes:
        total: every distinct parameter that multiplies activations.
        active: those one token runs through (routed experts at
            ``top_k / num_experts`` of theirs).
        note: how routed experts were counted; empty for a model without them.
    """

    total: int
    active: int
    note: str = ""

    def to_json(self) -> dict[str, object]:
        return {"total": self.total, "active": self.active, "note": self.note}


def compute_params(model: nn.Module) -> ComputeParams:
    """The ``N`` of the 6N rule for ``model`` (on any device; only shapes are read).

    Example:
        >>> compute_params(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)))
        ComputeParams(total=50, active=50, note='')
    """
    numel: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue  # unless another module (a tied head) multiplies by it
        for p in module.parameters(recurse=False):
            numel[id(p)] = p.numel()
    total = sum(numel.values())
    globs, experts = _routed_experts(model)
    if not experts:
        return ComputeParams(total, total)
    named = ", ".join(globs)
    top_k = _top_k(model)
    counts = [getattr(m, "num_experts", None) for m in experts]
    known = [n for n in counts if isinstance(n, int) and not isinstance(n, bool)]
    if top_k is None or len(known) < len(counts) or any(not 0 < top_k <= n for n in known):
        return ComputeParams(
            total, total, f"every routed expert of {named} counts (top_k or the expert count unknown): compute is an upper bound"
        )
    active = total
    for module, n in zip(experts, known):
        held = sum(numel.get(id(p), 0) for p in module.parameters())
        active -= held - held * top_k // n
    sizes = "/".join(str(n) for n in sorted(set(known)))
    return ComputeParams(
        total,
        active,
        f"routed experts ({named}) count top_k / num_experts = {top_k}/{sizes} of their parameters: each token runs "
        f"{top_k} of them",
    )


def _routed_experts(model: nn.Module) -> tuple[tuple[str, ...], list[nn.Module]]:
    """The globs naming the model's routed experts and the outermost modules they match."""
    from ..hf._declarations import expert_modules_of

    globs = expert_modules_of(model)
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        fqn = logical_fqn(name)
        if fqn and any(segment_match(g, fqn) for g in globs) and not any(fqn.startswith(f"{f}.") for f in found):
            found[fqn] = module
    return globs, list(found.values())


def _top_k(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for key in _TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
