"""``FSDP2Config`` and ``FSDP2Manager``: from a model and a mesh to a
tensor-parallel, sequence-parallel, checkpointed, prefetching FSDP2 model.

The manager is a pipeline of transforms plus :func:`fsdptx.apply_plan`,
nothing else: ``manager.plan(model)`` is the pure dry run and
``manager.parallelize(model)`` applies exactly that Plan, so what a job will
do can be printed, diffed and tested before any rank touches a GPU.

The config and its checks live in :mod:`fsdptx._manager_config`, and
:func:`gradient_sync_context` in :mod:`fsdptx._manager_sync`; both are
re-exported here, the place they are imported from.
"""

from __future__ import annotations

import contextlib
import functools
import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# CheckpointSetting and FrozenMapping (the type of FSDP2Config.tp_plan) stay importable from here.
from ._manager_config import CheckpointSetting, FSDP2Config, FrozenMapping
from ._manager_sync import gradient_sync_context
from .apply._apply import apply_indexed
from .apply._pipeline import LossFn, PipelineStages, apply_pipeline
from .compat._imperative import reject_unsupported_mtp_cp, reject_unsupported_mtp_cp_pp
from .core._args import require_module
from .core._meshes import ParallelDims, ep_size, moe_dp_dims, parallel_dims, tp_mesh
from .core._torch_internals import enable_symmetric_memory, micro_pipeline_tp, set_micro_pipeline_tp
from .hf._patches import patch_is_packed_sequence
from .plan._plan import Plan
from .model._index import ModelIndex, PlanningError, discover_blocks, resolve_blocks
from .plan._compose import Transform, compose, plan_indexed
# PipelineParallelConfig is re-exported: FSDP2Config(pipeline_parallel=...) takes one, and
# callers import both from here.
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
        from .hf._declarations import expert_modules_of

        return expert_modules_of(model)

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

        if cfg.sequence_parallel and self.dims.tp > 1 and _is_hugging_face(model):
            raise PlanningError(
                f"FSDP2Manager: {type(model).__name__} is a Hugging Face model, whose forward derives positions and "
                "the causal mask from the length of the hidden states it is given; under sequence parallelism every "
                "pipeline stage after the first is given its seq/tp shard, so those would be wrong. Set "
                "sequence_parallel=False with pipeline parallelism for this model (tensor parallelism still applies)"
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


def _is_hugging_face(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (its config names a
    ``model_type``), read without importing transformers."""
    return isinstance(getattr(getattr(model, "config", None), "model_type", None), str)


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
