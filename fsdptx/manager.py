"""``FSDP2Config`` and ``FSDP2Manager``: from a model and a mesh to a
tensor-parallel, sequence-parallel, checkpointed, prefetching FSDP2 model.

The manager is a pipeline of transforms plus :func:`fsdptx.apply_plan`,
nothing else: ``manager.plan(model)`` is the pure dry run and
``manager.parallelize(model)`` applies exactly that Plan, so what a job will
do can be printed, diffed and tested before any rank touches a GPU.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.parallel import ParallelStyle

from .apply._apply import apply_indexed
from .apply._pipeline import LossFn, PipelineStages, apply_pipeline
from .compat._imperative import reject_unsupported_mtp_cp, reject_unsupported_mtp_cp_pp
from .core._args import require_module
from .core._names import name_tokens
from .core._meshes import ParallelDims, ep_size, moe_dp_dims, parallel_dims, tp_mesh
from .core._policy import check_policy_dtypes
from .core._torch_internals import (
    enable_symmetric_memory,
    fsdp_is_root,
    fsdp_param_groups,
    fsdp_state,
    micro_pipeline_tp,
    set_micro_pipeline_tp,
)
from .hf._patches import patch_is_packed_sequence
from .plan._plan import Plan
from .model._index import ModelIndex, PlanningError, discover_blocks, resolve_blocks
from .plan._compose import Transform, compose, plan_indexed
from .plan._stages import PipelineParallelConfig, plan_pipeline
from .plan.transforms import (
    checkpoint_activations,
    expert_parallel,
    mark_reduction,
    prefetch,
    reduce_unused_params,
    reshard_policy,
    shard_across_blocks,
    shard_by_dtype,
)
from .tp import check_tensor_parallel, tensor_parallel, without_tensor_parallel

__all__ = ["FSDP2Config", "FSDP2Manager", "gradient_sync_context", "patch_is_packed_sequence"]

logger = logging.getLogger(__name__)

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


_CONFIG_ATTRIBUTES = frozenset(
    {
        "sequence_parallel",
        "tp_plan",
        "mp_policy",
        "offload_policy",
        "activation_checkpointing",
        "defer_fsdp_grad_sync",
        "reshard_after_forward",
        "enable_async_tensor_parallel",
        "enable_compile",
        "enable_fsdp2_prefetch",
        "fsdp2_backward_prefetch_depth",
        "fsdp2_forward_prefetch_depth",
    }
)


class FSDP2Manager:
    """Parallelize a model over ``device_mesh`` as ``config`` says.

    ``device_mesh`` is read by dim names (``dp_replicate``, ``dp_shard`` or
    ``dp``, ``cp``, ``tp``, ``pp``); ``moe_mesh``, when given, shards the
    expert modules (``config.expert_modules``, or what the model declares)
    over its data-parallel dims (HSDP when one of them is ``dp_replicate``
    or ``ep_replicate``), and, when it has an ``ep`` dim > 1, first splits
    them by expert across ``ep`` (:func:`fsdptx.expert_parallel`; the
    expert modules dispatch tokens themselves, see docs/manager.md).
    :meth:`plan` is the pure dry run; :meth:`parallelize` applies exactly
    that Plan.

    Args:
        config: the settings.
        device_mesh: the mesh, read by dim names.
        moe_mesh: the mesh expert modules shard over, if any.

    Example::

        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh)
        print(manager.plan(model))        # pure: review before anything changes
        model = manager.parallelize(model)
    """

    def __init__(self, config: FSDP2Config, device_mesh: DeviceMesh, moe_mesh: DeviceMesh | None = None) -> None:
        if not isinstance(config, FSDP2Config):
            raise TypeError(f"FSDP2Manager: config must be an FSDP2Config, got {type(config).__name__}")
        for argument, mesh in (("device_mesh", device_mesh), ("moe_mesh", moe_mesh)):
            if not (isinstance(mesh, DeviceMesh) or (mesh is None and argument == "moe_mesh")):
                raise TypeError(f"FSDP2Manager: {argument} must be a torch DeviceMesh, got {type(mesh).__name__}")
        self.dims: ParallelDims = parallel_dims(device_mesh)
        _check_pipeline_dims(config, device_mesh, self.dims)
        if moe_mesh is not None:
            # parallelize() refuses a MoE mesh over another world or without a
            # data-parallel dim; refusing it here makes plan() (the dry run)
            # fail exactly where the real run would.
            moe_dp_dims(moe_mesh, device_mesh)
        elif config.expert_modules:
            logger.warning(
                "FSDP2Manager: expert_modules=%r has no effect without a moe_mesh; the experts are "
                "sharded with their blocks over device_mesh (pass moe_mesh= to shard them apart)",
                config.expert_modules,
            )
        self.config = config
        self.device_mesh = device_mesh
        self.moe_mesh = moe_mesh
        self._inductor_micro_pipeline_tp: list[bool] = []  # values async TP replaced, to restore
        if config.tp_plan is not None and self.dims.tp == 1:
            logger.info("FSDP2Manager: tp_plan is not applied (nor checked) without a tp dim of size > 1")

    def __getattr__(self, name: str) -> object:
        """The reference's attributes (``manager.sequence_parallel``,
        ``manager.mp_policy``, ...) read through to the config, so code
        written against the reference keeps working and there is one source
        of truth."""
        if name in _CONFIG_ATTRIBUTES:
            return getattr(self.__dict__["config"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def pipeline(self, model: nn.Module) -> Transform:
        """The transforms this manager runs, configured from the config and
        the mesh: TP, checkpointing, dtype and cross-block units, reduction
        marks, reshard policy, prefetch (each only where it applies)."""
        cfg, dims = self.config, self.dims
        blocks = cfg.blocks
        steps: list[Transform] = []
        if dims.tp > 1:
            steps.append(
                functools.partial(
                    tensor_parallel,
                    plan=cfg.tp_plan,
                    sequence_parallel=cfg.sequence_parallel,
                    loss_parallel=cfg.loss_parallel,
                    blocks=blocks,
                    moe_mesh_experts=self._expert_modules(model),
                )
            )
        elif cfg.sequence_parallel or cfg.loss_parallel:  # said on the Plan's first lines
            steps.append(
                functools.partial(
                    without_tensor_parallel, sequence_parallel=cfg.sequence_parallel, loss_parallel=cfg.loss_parallel
                )
            )
        if cfg.checkpoint_mode is not None:
            steps.append(functools.partial(checkpoint_activations, mode=cfg.checkpoint_mode, blocks=blocks))
        units = self._plans_units()
        if units:
            steps += [
                functools.partial(shard_by_dtype, expert_modules=self._expert_modules(model), blocks=blocks),
                functools.partial(shard_across_blocks, module_names=cfg.cross_block_modules, blocks=blocks),
            ]
        if ep_size(self.moe_mesh) > 1:
            steps.append(
                functools.partial(expert_parallel, expert_modules=self._expert_modules(model), ep=ep_size(self.moe_mesh))
            )
        steps.append(mark_reduction)
        if units:
            staged = cfg.pipeline_parallel is not None
            steps.append(functools.partial(reshard_policy, pipeline_parallel=staged))
            if cfg.enable_fsdp2_prefetch:
                steps.append(
                    functools.partial(
                        prefetch,
                        forward_depth=cfg.fsdp2_forward_prefetch_depth,
                        backward_depth=cfg.fsdp2_backward_prefetch_depth,
                    )
                )
            if dims.cp > 1:
                steps.append(reduce_unused_params)
        return compose(*steps)

    def _plans_units(self) -> bool:
        """FSDP units are planned when several ranks share the parameters,
        and also on one data-parallel rank when a mixed-precision or
        offload policy must be applied: FSDP is what applies them."""
        cfg = self.config
        return self.dims.sharding_enabled or cfg.mp_policy is not None or cfg.offload_policy is not None

    def _expert_modules(self, model: nn.Module) -> tuple[str, ...]:
        """Experts get units of their own only when there is a MoE mesh for
        them; otherwise they are part of their blocks' units."""
        if self.moe_mesh is None:
            return ()
        if self.config.expert_modules is not None:
            return tuple(self.config.expert_modules)
        from .hf import hf_expert_modules

        declared = getattr(model, "_fsdptx_expert_modules", None)
        return tuple(declared) if declared else hf_expert_modules(model)

    def plan(self, model: nn.Module) -> Plan:
        """The Plan :meth:`parallelize` will apply; pure, safe on a meta model.

        Also checks what needs the mesh (TP divisibility, the MTP guards under
        context parallelism), so a dry run fails where the real run would.
        """
        require_module(model, "model", "FSDP2Manager.plan")
        return self._plan(model, ModelIndex.build(model))

    def _plan(self, model: nn.Module, index: ModelIndex) -> Plan:
        """:meth:`plan`, reading ``index``, the model's index built a moment ago."""
        if self.dims.cp > 1:
            reject_unsupported_mtp_cp(model)
            reject_unsupported_mtp_cp_pp(model, self.dims.pp)
        if self.config.pipeline_parallel is not None:
            return self._plan_stages(model, index)
        result = plan_indexed(
            model,
            self.pipeline(model),
            index,
            mp_policy=self.config.mp_policy,
            offload_policy=self.config.offload_policy,
            reshard_after_forward=self.config.reshard_after_forward,
        )
        self._check_tp(result, model, index)
        note = self._one_rank_note(result)
        if note is not None and note not in result.warnings:
            result = result.replace(warnings=result.warnings + (note,))
        return result

    def _check_tp(self, result: Plan, model: nn.Module, index: ModelIndex | None) -> None:
        if result.tensor_parallel is not None:
            problems = check_tensor_parallel(result.tensor_parallel, model, self.dims.tp, index=index)
            if problems:
                raise ValueError("FSDP2Manager: the TP plan does not fit tp=%d:\n  - %s" % (self.dims.tp, "\n  - ".join(problems)))

    def _one_rank_note(self, planned: Plan) -> str | None:
        """What the Plan says when it has FSDP units on one data-parallel
        rank: they shard nothing and are there only because FSDP is what
        applies the policies (:meth:`_plans_units`). On a world of one rank
        the reference skips FSDP altogether, so its parameters compute in
        their storage dtype; fsdptx keeps the cast the config asks for and
        says so, with the setting that gives the reference's behaviour."""
        if self.dims.sharding_enabled or not planned.units:
            return None
        policies = " and ".join(
            name for name, value in (("mp_policy", self.config.mp_policy), ("offload_policy", self.config.offload_policy))
            if value is not None
        )
        if self.device_mesh.size() == 1:
            where = (
                "a world of one rank: the FSDP units shard nothing; they are planned only to apply "
                f"{policies} (FSDP is what applies them). The reference skips FSDP on one rank and leaves "
                "every parameter computing in its storage dtype"
            )
        else:
            where = (
                "one data-parallel rank: the FSDP units shard nothing; they are planned only to apply "
                f"{policies} (FSDP is what applies them), on a data-parallel mesh of size 1 as the reference does"
            )
        return f"{where}; for no FSDP units pass FSDP2Config(mp_policy=None, offload_policy=None)"


    def _plan_stages(self, model: nn.Module, index: ModelIndex) -> Plan:
        """The pipelined Plan: every stage planned by this manager's
        pipeline of transforms on its own stage module, and its TP plan
        checked against that module."""
        cfg = self.config
        assert cfg.pipeline_parallel is not None
        supports = getattr(model, "supports", None)
        if getattr(supports, "mtp_enabled", False) is True:
            raise PlanningError(
                f"FSDP2Manager: {type(model).__name__} has multi-token prediction enabled; its MTP modules read the "
                "embedding and the last hidden states, which pipeline stages keep apart: disable MTP under pipeline parallelism"
            )

        def stage_pipeline(stage: nn.Module, p: Plan, /) -> Plan:
            planned = self.pipeline(stage)(stage, p)
            self._check_tp(planned, stage, None)
            return planned

        return plan_pipeline(
            model,
            stage_pipeline,
            cfg.pipeline_parallel,
            pp=self.dims.pp,
            blocks=cfg.blocks,
            mp_policy=cfg.mp_policy,
            offload_policy=cfg.offload_policy,
            reshard_after_forward=cfg.reshard_after_forward,
            index=index,
        )

    def parallelize(self, model: nn.Module, *, loss_fn: LossFn | None = None) -> nn.Module | PipelineStages:
        """Apply :meth:`plan` to ``model`` with :func:`fsdptx.apply_plan`
        (everything validated before anything is mutated); returns ``model``.
        The Plan's warnings (no blocks found, say) are logged.

        With ``config.pipeline_parallel``, builds and parallelizes this
        rank's stages instead (:func:`fsdptx.apply_pipeline`) and returns
        :class:`fsdptx.PipelineStages`; ``loss_fn(output, target)`` is then
        required: the last stage computes it per micro-batch.

        The model is walked once: planning, the plan's checks and the
        effects all read that walk's index (nothing changes the model
        between planning and applying, so the index is current when the
        checks read it; every check still runs before any mutation)."""
        require_module(model, "model", "FSDP2Manager.parallelize")
        staged = self.config.pipeline_parallel is not None
        if staged and not callable(loss_fn):
            raise TypeError(
                "FSDP2Manager.parallelize: pipeline parallelism needs loss_fn=callable(output, target) -> loss, "
                f"computed on the last stage per micro-batch; got {loss_fn!r}"
            )
        if not staged and loss_fn is not None:
            raise ValueError("FSDP2Manager.parallelize: loss_fn is for pipeline parallelism (FSDP2Config(pipeline_parallel=...))")
        index = ModelIndex.build(model)
        planned = self._plan(model, index)
        for warning in planned.warnings:
            logger.warning("FSDP2Manager: %s", warning)
        if planned.pipeline is not None:
            assert loss_fn is not None
            for stage in planned.pipeline.stages:
                for warning in stage.plan.warnings:
                    logger.warning("FSDP2Manager: stage %d: %s", stage.index, warning)
            stages = apply_pipeline(planned, model, self.device_mesh, loss_fn=loss_fn, moe_mesh=self.moe_mesh)
            if self.config.patch_is_packed_sequence:
                patch_is_packed_sequence()
            return stages
        result = apply_indexed(planned, model, self.device_mesh, index, moe_mesh=self.moe_mesh)
        if self.config.patch_is_packed_sequence:
            patch_is_packed_sequence()
        return result

    def maybe_compile(self, model: nn.Module) -> nn.Module:
        """Compile each block in place after sharding, when ``enable_compile``
        (or async TP with tp > 1) asks for it; returns ``model``.

        In-place ``nn.Module.compile`` keeps FQNs and the FSDP hooks; compiling
        per block (not the whole model) keeps graphs small and lets FSDP's
        per-block collectives overlap with compute. Async TP turns on
        inductor's micro-pipelined TP and symmetric memory for the TP group
        where torch supports it (CUDA), and logs where it cannot. Inductor
        reads that switch when a graph compiles (at the first call, not
        here), so it stays on for the process: :meth:`restore_async_tensor_parallel`
        puts back the value it had before.
        """
        require_module(model, "model", "FSDP2Manager.maybe_compile")
        async_tp = self.config.enable_async_tensor_parallel and self.dims.tp > 1
        if async_tp:
            self._inductor_micro_pipeline_tp.append(_enable_async_tp(self.device_mesh))
        if not (self.config.enable_compile or async_tp):
            return model
        blocks = resolve_blocks(self.config.blocks, ModelIndex.build(model), "maybe_compile") if self.config.blocks else discover_blocks(model)
        for fqn in blocks or ("",):
            model.get_submodule(fqn).compile()
        return model

    def restore_async_tensor_parallel(self) -> None:
        """Put inductor's micro-pipelined TP switch back as it was before
        :meth:`maybe_compile` turned it on (a no-op when it did not), so
        graphs compiled later in the process (another model, evaluation)
        are not built for async TP. Symmetric memory, once enabled for the
        TP group, stays enabled (torch has no way to turn it off)."""
        while self._inductor_micro_pipeline_tp:
            set_micro_pipeline_tp(self._inductor_micro_pipeline_tp.pop())

    def gradient_sync_context(self, model: nn.Module, is_optimizer_step: bool) -> contextlib.AbstractContextManager[None]:
        """:func:`gradient_sync_context` with ``defer=config.defer_fsdp_grad_sync``."""
        require_module(model, "model", "FSDP2Manager.gradient_sync_context")
        if not isinstance(is_optimizer_step, bool):
            raise TypeError(
                "FSDP2Manager.gradient_sync_context: is_optimizer_step must be a bool, "
                f"got {type(is_optimizer_step).__name__} {is_optimizer_step!r}"
            )
        return gradient_sync_context(model, is_optimizer_step, defer=self.config.defer_fsdp_grad_sync)


def _check_pipeline_dims(config: FSDP2Config, mesh: DeviceMesh, dims: ParallelDims) -> None:
    """A ``pp`` dim and a pipeline config come together: stages without a
    ``pp`` dim have no ranks to run on, and a ``pp`` dim of several ranks
    without stages would have every pipeline rank train the whole model."""
    has_pp = "pp" in (mesh.mesh_dim_names or ())
    if config.pipeline_parallel is not None and not has_pp:
        raise ValueError(
            "FSDP2Manager: FSDP2Config.pipeline_parallel is set but device_mesh has no 'pp' dim; build the mesh with "
            "a 'pp' dim (init_device_mesh(..., mesh_dim_names=('pp', 'dp', ...)))"
        )
    if config.pipeline_parallel is None and dims.pp > 1:
        raise ValueError(
            f"FSDP2Manager: device_mesh has a 'pp' dim of {dims.pp} ranks but no pipeline configuration; pass "
            "FSDP2Config(pipeline_parallel=fsdptx.PipelineParallelConfig(...)), or drop the 'pp' dim"
        )


def _enable_async_tp(mesh: DeviceMesh) -> bool:
    """Turn on inductor's micro-pipelined TP; returns the value it replaced."""
    previous = micro_pipeline_tp()
    group = tp_mesh(mesh)
    set_micro_pipeline_tp(True)
    if group is None:
        return previous
    try:
        if mesh.device_type != "cuda":
            raise RuntimeError(f"symmetric memory needs CUDA, the mesh is on {mesh.device_type}")
        enable_symmetric_memory(group.get_group().group_name)
    except (ImportError, RuntimeError) as e:
        logger.warning("async tensor parallel: symmetric memory not enabled for the TP group (%s)", e)
    return previous


@contextlib.contextmanager
def gradient_sync_context(model: nn.Module, is_optimizer_step: bool, *, defer: bool = True) -> Iterator[None]:
    """Run one micro-batch's backward inside this context.

    With ``defer``, FSDP reduce-scatters gradients only on the micro-batch
    that ends the optimizer step (``is_optimizer_step=True``); the others
    accumulate unsharded gradients locally, so N micro-batches cost one
    reduce-scatter per unit instead of N. Without ``defer`` every micro-batch
    reduces (less memory, more communication). A model with no FSDP unit is
    left alone.

    On exit every unit gets back the sync setting it had on entry (not
    "on"): nested contexts then compose, and a unit whose sync the user had
    turned off stays off. Arguments are checked before any unit changes.

    ``model`` must be the whole model: a block (or the list of blocks) of a
    larger FSDP model is refused, since deferring it alone would leave the
    units outside it reducing on every micro-batch. FSDP knows which unit
    is the root only from the first forward on, so a part given to the
    first context is refused when that context exits, and on entry after.

    Args:
        model: the (partly) FSDP-sharded model.
        is_optimizer_step: whether this micro-batch ends the optimizer step.
        defer: whether to skip the reduce-scatter on the other micro-batches.

    Yields:
        Nothing; the backward runs inside.

    Raises:
        TypeError: ``is_optimizer_step`` or ``defer`` is not a bool.
        RuntimeError: ``model`` is part of a larger FSDP model.

    Example::

        for i, batch in enumerate(micro_batches):
            with fsdptx.gradient_sync_context(model, is_optimizer_step=i == len(micro_batches) - 1):
                model(batch).sum().backward()
    """
    require_module(model, "model", "gradient_sync_context")
    if not isinstance(is_optimizer_step, bool):
        raise TypeError(
            f"gradient_sync_context: is_optimizer_step must be a bool (True on the micro-batch that ends "
            f"the optimizer step), got {type(is_optimizer_step).__name__} {is_optimizer_step!r}"
        )
    if not isinstance(defer, bool):
        raise TypeError(f"gradient_sync_context: defer must be a bool, got {type(defer).__name__} {defer!r}")
    states = _fsdp_states(model)
    _refuse_a_part(model, states)
    groups = [g for state in states for g in fsdp_param_groups(state)]
    if not defer or not groups:
        yield
        return
    saved = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
    for g in groups:
        g.reduce_grads = is_optimizer_step
        g.all_reduce_grads = is_optimizer_step
    try:
        yield
    finally:
        for g, reduce_grads, all_reduce_grads in saved:
            g.reduce_grads = reduce_grads
            g.all_reduce_grads = all_reduce_grads
    # The first forward is where FSDP decides which unit is the root: a
    # part of a larger model is only known as one after it (see _refuse_a_part).
    _refuse_a_part(model, states)


def _refuse_a_part(model: nn.Module, states: list[Any]) -> None:
    """Refuse a ``model`` that is part of a larger FSDP model (a block, or a
    container of blocks, whose root unit is outside it): deferring it alone
    would leave every unit outside it reduce-scattering on each micro-batch.
    FSDP marks every unit under the root as not the root at the first
    forward, so a part is known from then on; before it, a part cannot be
    told from a whole model, and the check after the first context's body
    catches it (its backward ran, and is correct, only not deferred for the
    units outside)."""
    if states and all(fsdp_is_root(s) is False for s in states):
        raise RuntimeError(
            f"gradient_sync_context: model ({type(model).__name__}) is part of a larger FSDP model: its "
            "units' root is outside it, so deferring it alone would leave the rest of the model "
            "reduce-scattering on every micro-batch; pass the whole model (what parallelize returned)"
        )


def _fsdp_states(model: nn.Module) -> list[Any]:
    """Each FSDP state under ``model`` once (a unit spanning several modules
    shares one), in module order. Its parameter groups are where FSDP2
    keeps the flags ``set_requires_gradient_sync`` sets, ``reduce_grads``
    and ``all_reduce_grads``, so they can be read back and restored."""
    seen: set[int] = set()
    states: list[Any] = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = fsdp_state(m)
            if id(state) not in seen:
                seen.add(id(state))
                states.append(state)
    return states

