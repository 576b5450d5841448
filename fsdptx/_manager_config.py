"""``FSDP2Config``: the manager's settings and their checks.

A module of its own so the settings, and every check that refuses a bad
one at construction (before any process group work), read apart from the
manager that acts on them. :mod:`fsdptx.manager` re-exports
:class:`FSDP2Config`; that is where it is imported from.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .core._names import name_tokens
from .core._policy import check_policy_dtypes
from .plan._stages import PipelineParallelConfig

__all__ = ["CheckpointSetting", "FSDP2Config", "FrozenMapping"]

CheckpointSetting = bool | Literal["full", "selective"]

_BF16_POLICY = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32,
    output_dtype=torch.bfloat16,
    cast_forward_inputs=True,
)


_V = TypeVar("_V")


class FrozenMapping(Mapping[str, _V]):
    """A read-only, hashable mapping: what ``FSDP2Config.tp_plan`` stores, so
    the frozen config is frozen all the way down (a dict given at
    construction can be changed afterwards by whoever kept it) and hashes
    (``MappingProxyType`` does not). Items are kept sorted by key, so two
    plans with the same entries are equal and hash alike whatever order they
    were written in. Values are hashed by identity where they define no
    hash of their own (torch ``ParallelStyle`` objects)."""

    __slots__ = ("_items", "_lookup")

    def __init__(self, source: Mapping[str, _V]) -> None:
        self._items: tuple[tuple[str, _V], ...] = tuple(sorted(source.items(), key=lambda kv: kv[0]))
        self._lookup: dict[str, _V] = dict(self._items)

    def __getitem__(self, key: str) -> _V:
        return self._lookup[key]

    def __iter__(self) -> Iterator[str]:
        return (k for k, _v in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple((k, _hashable(v)) for k, v in self._items))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenMapping({dict(self._items)!r})"


def _hashable(value: object) -> object:
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _check_tp_plan(plan: object) -> FrozenMapping[str | ParallelStyle] | None:
    """``tp_plan`` as an immutable mapping, every entry checked now: a
    non-string key, a style that is neither one of
    :data:`fsdptx.tp.STYLE_NAMES` nor a torch ``ParallelStyle`` (an int, a
    typo, ``None``) fails at construction, naming the entry, instead of at
    the first TP plan resolution on every rank."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        raise TypeError(f"FSDP2Config.tp_plan must be a mapping of module glob -> style, got {plan!r}")
    from .tp import EXPERT_PARAM_STYLES, EXPERTS_STYLE, STYLE_NAMES

    # Names a module or an expert weight may get: the experts' own are
    # meaningful only together (checked per module when the plan resolves).
    names = tuple(sorted({*STYLE_NAMES, EXPERTS_STYLE, *EXPERT_PARAM_STYLES}))

    for key, style in plan.items():
        if not isinstance(key, str):
            raise TypeError(
                f"FSDP2Config.tp_plan: key {key!r} must be a module glob (str), got {type(key).__name__}"
            )
        if isinstance(style, ParallelStyle):
            continue
        if not isinstance(style, str):
            raise TypeError(
                f"FSDP2Config.tp_plan[{key!r}]: style must be a style name or a torch ParallelStyle, "
                f"got {style!r}; use one of {', '.join(names)}"
            )
        if style not in names:
            close = difflib.get_close_matches(style, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"FSDP2Config.tp_plan[{key!r}]: unknown style {style!r}{hint} "
                f"(names: {', '.join(names)}, or a torch ParallelStyle)"
            )
    return FrozenMapping(plan)


@dataclass(frozen=True)
class FSDP2Config:
    """Settings of :class:`FSDP2Manager`.

    The reference page lists these fields without their defaults; the
    defaults here are fsdptx's own choices (see ``docs/manager.md``).

    ``mp_policy=None`` means mixed precision disabled: every unit computes
    in its storage dtype. (The reference silently substitutes a bf16 policy
    for ``None``; fsdptx does not, so fp32 parity runs are possible.) The
    default is bf16 compute, fp32 gradient reduction, bf16 output.

    ``activation_checkpointing``: ``False``, ``True`` (same as ``"full"``),
    ``"full"`` or ``"selective"``. ``reshard_after_forward=None`` lets the
    reshard policy decide (blocks but the last reshard, the root never,
    nothing under pipeline parallelism). Prefetch depths are how many
    blocks ahead each block all-gathers. Invalid values fail here, naming
    the field, so a typo in a launcher fails before any process group work.

    ``tp_plan`` maps module globs to style names (:data:`fsdptx.tp.STYLE_NAMES`)
    or torch ``ParallelStyle`` objects; it is checked entry by entry here
    and stored as a read-only, hashable mapping, so the config stays frozen
    and hashable. ``mp_policy`` dtypes must be floating.

    ``defer_fsdp_grad_sync`` is the ``defer`` of :meth:`FSDP2Manager.gradient_sync_context`,
    the one place it is read: with ``True`` gradient accumulation
    reduce-scatters only on the micro-batch that ends the optimizer step,
    with ``False`` on every micro-batch. The module-level
    :func:`gradient_sync_context` reads no config (``defer=True`` unless
    passed).

    Beyond the reference: ``expert_modules`` (globs of expert modules,
    sharded over ``moe_mesh``; default: what the model declares; given
    without a ``moe_mesh`` it has no effect, and the manager logs a warning
    saying so), ``cross_block_modules`` (block-relative names whose fp32
    holders become one unit across all blocks, e.g. ``("self_attn",)`` for
    GPT-OSS sinks; default: the model's ``_fsdp_shard_across_blocks``),
    ``blocks`` (the model's blocks as class names, FQNs or globs such as
    ``"layers.*"``; default: ``_no_split_modules``, else the largest
    ``nn.ModuleList`` or ``nn.ModuleDict`` of same-class children) and
    ``loss_parallel`` (with tensor parallelism, the head's logits stay
    vocabulary-sharded DTensors; compute the loss under
    :func:`fsdptx.loss_parallel`).

    The mixed-precision policy applies on every mesh: with one
    data-parallel rank each block is still an FSDP unit (on a size-1
    data-parallel mesh), which is what casts it; the Plan's warnings say
    so. The reference does the same with a ``tp`` dim, but skips FSDP (and
    so the cast) on a world of one rank; ``mp_policy=None`` with no
    ``offload_policy`` gives that (no units; checkpointing still applies).

    Deliberately absent: ``activation_checkpointing_scope``,
    ``autocast_dtype`` and ``multimodal``. The reference pages fsdptx is
    modelled on do not define them, so there is no behaviour to match;
    ``activation_checkpointing`` covers the blocks, and ``mp_policy`` is
    the one place compute dtypes are set (no autocast).

    Attributes:
        sequence_parallel: run the blocks on the sequence shard (needs a
            ``tp`` dim).
        tp_plan: module glob -> style name or torch ``ParallelStyle``; the
            model's declared plan when ``None``.
        patch_is_packed_sequence: apply :func:`patch_is_packed_sequence`.
        mp_policy: the mixed-precision policy; ``None`` means disabled.
        offload_policy: every unit's offload policy.
        activation_checkpointing: ``False``, ``True``, ``"full"`` or
            ``"selective"``.
        defer_fsdp_grad_sync: the default ``defer`` of gradient accumulation.
        reshard_after_forward: ``None`` (the reshard policy), a bool or a
            group size.
        enable_async_tensor_parallel: overlap the sequence collectives with
            the matmuls (needs ``sequence_parallel`` and CUDA).
        enable_compile: ``torch.compile`` each block.
        enable_fsdp2_prefetch: chain explicit prefetches between blocks.
        fsdp2_backward_prefetch_depth: blocks all-gathered ahead in backward.
        fsdp2_forward_prefetch_depth: blocks all-gathered ahead in forward.
        expert_modules: globs of expert modules (a bare string is one glob).
        cross_block_modules: holders made one unit across blocks (a bare
            string is one name).
        blocks: the model's blocks (a bare string is one name or glob).
        loss_parallel: keep the head's logits vocabulary-sharded.
        pipeline_parallel: split the model into pipeline stages over the
            mesh's ``pp`` dim (:class:`fsdptx.PipelineParallelConfig`);
            :meth:`FSDP2Manager.parallelize` then returns
            :class:`fsdptx.PipelineStages`.

    Example::

        config = fsdptx.FSDP2Config(sequence_parallel=True, activation_checkpointing="selective")
        model = fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    """

    sequence_parallel: bool = False
    tp_plan: Mapping[str, str | ParallelStyle] | None = None
    patch_is_packed_sequence: bool = False
    mp_policy: MixedPrecisionPolicy | None = field(default_factory=lambda: _BF16_POLICY)
    offload_policy: OffloadPolicy | None = None
    activation_checkpointing: CheckpointSetting = False
    defer_fsdp_grad_sync: bool = True
    reshard_after_forward: bool | int | None = None
    enable_async_tensor_parallel: bool = False
    enable_compile: bool = False
    enable_fsdp2_prefetch: bool = True
    fsdp2_backward_prefetch_depth: int = 2
    fsdp2_forward_prefetch_depth: int = 1
    expert_modules: tuple[str, ...] | None = None
    cross_block_modules: tuple[str, ...] | None = None
    blocks: tuple[str, ...] | None = None
    loss_parallel: bool = False
    pipeline_parallel: PipelineParallelConfig | None = None

    def __post_init__(self) -> None:
        for name in (
            "sequence_parallel",
            "patch_is_packed_sequence",
            "defer_fsdp_grad_sync",
            "enable_async_tensor_parallel",
            "enable_compile",
            "enable_fsdp2_prefetch",
            "loss_parallel",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FSDP2Config.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"FSDP2Config.{name} must be a non-negative int, got {value!r}")
        ac = self.activation_checkpointing
        if not (isinstance(ac, bool) or ac in ("full", "selective")):
            raise ValueError(
                f"FSDP2Config.activation_checkpointing must be False, True, 'full' or 'selective', got {ac!r}"
            )
        if self.enable_async_tensor_parallel and not self.sequence_parallel:
            raise ValueError(
                "FSDP2Config.enable_async_tensor_parallel needs sequence_parallel=True: async TP overlaps "
                "the sequence all-gather / reduce-scatter with the matmuls next to them"
            )
        if self.mp_policy is not None and not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(f"FSDP2Config.mp_policy must be a MixedPrecisionPolicy or None, got {self.mp_policy!r}")
        if self.offload_policy is not None and not isinstance(self.offload_policy, OffloadPolicy):
            raise TypeError(f"FSDP2Config.offload_policy must be an OffloadPolicy or None, got {self.offload_policy!r}")
        r = self.reshard_after_forward
        if not (r is None or isinstance(r, bool) or (type(r) is int and r >= 1)):
            raise ValueError(f"FSDP2Config.reshard_after_forward must be None, a bool or an int >= 1, got {r!r}")
        if self.pipeline_parallel is not None and not isinstance(self.pipeline_parallel, PipelineParallelConfig):
            raise TypeError(
                f"FSDP2Config.pipeline_parallel must be an fsdptx.PipelineParallelConfig or None, got {self.pipeline_parallel!r}"
            )
        object.__setattr__(self, "tp_plan", _check_tp_plan(self.tp_plan))
        check_policy_dtypes(self.mp_policy, "FSDP2Config")
        for name in ("expert_modules", "cross_block_modules", "blocks"):
            value = getattr(self, name)
            if value is not None:
                # Stored as a tuple (the config stays hashable); a bare string is one name.
                names = name_tokens(value, f"FSDP2Config.{name}")
                if "" in names:
                    raise ValueError(
                        f"FSDP2Config.{name} holds an empty name in {names!r}; give module names or globs "
                        "(an empty one would match the root or every module)"
                    )
                object.__setattr__(self, name, names)

    @property
    def checkpoint_mode(self) -> Literal["full", "selective"] | None:
        ac = self.activation_checkpointing
        return None if ac is False else ("full" if ac is True else ac)
