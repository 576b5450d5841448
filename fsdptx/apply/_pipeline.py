"""Applying a pipelined Plan: this rank's stage modules, each parallelized by
its own Plan, wrapped as torch pipeline stages and driven by torch's
schedule.

Every stage this rank runs is built (a new spine over the model's parts,
FQNs kept) and checked against its Plan and the mesh before any of them is
changed; then each stage's Plan is applied exactly as :func:`fsdptx.apply_plan`
applies a whole model's (TP, checkpointing, FSDP units on the mesh's
non-pipeline dims, prefetch, marks), and the stage is handed to
``torch.distributed.pipelining``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

from ..core._args import require_callable, require_module
from ..core._torch_internals import composable_checkpoint
from ..model._index import ModelIndex
from ..model._stages import PipelineParts, build_stage_module
from ..plan._plan import Pipeline, Plan
from ..plan._stages import microbatch_problem
from ._apply import CheckpointModule, ParallelizeModule, ShardModule, apply_resolved, precheck
from ._check import checked_units, fail, require_mesh
from ._experts import HandEpMesh, hand_ep_mesh

__all__ = ["LossFn", "MakeStage", "PipelineStages", "apply_pipeline", "pipeline_coordinate"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MakeStage = Callable[..., Any]


class PipelineStages(Sequence[nn.Module]):
    """This rank's parallelized pipeline stages and the schedule that runs them.

    Iterating yields the stage modules, so the object is itself the
    ``model_parts`` of :func:`fsdptx.synchronize_tp_replica_gradients`,
    :func:`fsdptx.audit_replicas` and :func:`fsdptx.clip_grad_norm_`, and
    ``[p for m in stages for p in m.parameters()]`` is what the optimizer
    steps.

    Attributes:
        modules: this rank's stage modules, in pipeline order (their FQNs are
            the whole model's: checkpoints load across pipeline sizes).
        schedule: torch's schedule object.
        stages: torch's ``PipelineStage`` objects, one per module.
        indices: the pipeline index of each module.
        is_first: whether this rank runs the first stage (it takes inputs).
        is_last: whether this rank runs the last stage (it takes targets and
            computes the loss).
        microbatches: micro-batches per step.
        pipeline: the Plan's pipeline.

    Example::

        stages = manager.parallelize(model, loss_fn=loss_fn)
        losses = stages.step(inputs=tokens if stages.is_first else None, target=labels if stages.is_last else None)
    """

    def __init__(
        self, modules: list[nn.Module], stages: list[Any], schedule: Any, indices: tuple[int, ...], pipeline: Pipeline
    ) -> None:
        self.modules = modules
        self.stages = stages
        self.schedule = schedule
        self.indices = indices
        self.pipeline = pipeline
        self.microbatches = pipeline.microbatches
        self.is_first = 0 in indices
        self.is_last = len(pipeline.stages) - 1 in indices

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.modules)

    def __len__(self) -> int:
        return len(self.modules)

    @overload
    def __getitem__(self, i: int) -> nn.Module: ...

    @overload
    def __getitem__(self, i: slice) -> list[nn.Module]: ...

    def __getitem__(self, i: int | slice) -> nn.Module | list[nn.Module]:
        return self.modules[i]

    def __repr__(self) -> str:
        return f"PipelineStages(indices={self.indices}, schedule={self.pipeline.schedule}, microbatches={self.microbatches})"

    def step(self, inputs: torch.Tensor | None = None, target: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """One optimizer step's forwards and backwards over the micro-batches.

        The first stage's rank passes the whole batch as ``inputs``, the last
        stage's the whole batch's ``target``; both are split into
        ``microbatches`` along dim 0, which must divide evenly (checked here,
        before any stage runs). Gradients accumulate in the parameters, scaled
        so that a ``loss_fn`` that means over its micro-batch gives the
        gradient of the mean over the batch; call ``optimizer.step()`` after.

        Args:
            inputs: the batch, on the first stage's rank (ignored elsewhere).
            target: the batch's targets, on the last stage's rank.

        Returns:
            The per-micro-batch losses on the last stage's rank; ``None``
            elsewhere.

        Raises:
            ValueError: a missing input or target, or a batch the
                micro-batches do not divide.
        """
        for name, value, needed in (("inputs", inputs, self.is_first), ("target", target, self.is_last)):
            if not needed:
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"PipelineStages.step: this rank runs the {'first' if name == 'inputs' else 'last'} stage and "
                    f"needs {name} (a tensor), got {type(value).__name__}"
                )
            if value.ndim == 0 or value.shape[0] % self.microbatches:
                raise ValueError(
                    f"PipelineStages.step: {name} has batch size {value.shape[0] if value.ndim else 0}, which "
                    f"{self.microbatches} micro-batches do not divide; use a batch divisible by {self.microbatches}"
                )
        args = (inputs,) if self.is_first else ()
        losses: list[torch.Tensor] | None = [] if self.is_last else None
        # return_outputs=False: torch's schedule would otherwise keep every
        # micro-batch's output (the logits) on the last stage for the whole
        # step and concatenate them into one more batch-sized copy, which
        # step() never returns.
        self.schedule.step(*args, target=target if self.is_last else None, losses=losses, return_outputs=False)
        return losses


def pipeline_coordinate(mesh: DeviceMesh, pipeline: Pipeline, where: str) -> int:
    """This rank's coordinate on ``mesh``'s ``pp`` dim, checked against the
    Plan's pipeline size."""
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names:
        raise ValueError(f"{where}: the Plan has pipeline stages but the mesh {names} has no 'pp' dim")
    size = mesh.shape[names.index("pp")]
    if size != pipeline.size:
        raise ValueError(f"{where}: the Plan was made for pp={pipeline.size}, the mesh's pp dim has {size} ranks; re-plan")
    return int(mesh.get_local_rank("pp"))


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def apply_pipeline(
    plan: Plan,
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    loss_fn: LossFn,
    moe_mesh: DeviceMesh | None = None,
    shard_module: ShardModule = fully_shard,
    parallelize_module: ParallelizeModule = torch_parallelize_module,
    checkpoint_module: CheckpointModule = composable_checkpoint,
    hand_ep_mesh: HandEpMesh = hand_ep_mesh,
    make_stage: MakeStage = PipelineStage,
) -> PipelineStages:
    """Carry out a pipelined Plan on this rank: build, check and parallelize
    the stages its ``pp`` coordinate runs, and schedule them.

    Every stage is checked (units against its module, the mesh, styles,
    checkpointing) before the first one changes; the model's modules become
    the stages' (parallelized in place), so use the returned stages, not
    ``model``, from here on.

    Args:
        plan: a Plan with ``pipeline`` (from ``FSDP2Manager.plan`` or
            :func:`fsdptx.plan_pipeline`).
        model: the whole model it was planned for.
        mesh: the device mesh with a ``pp`` dim; each stage is parallelized
            over its other dims.
        loss_fn: ``loss_fn(output, target)`` on the last stage, per micro-batch.
        moe_mesh: the mesh expert units shard over, if any.
        shard_module: the FSDP primitive.
        parallelize_module: the TP primitive.
        checkpoint_module: the activation-checkpoint primitive.
        hand_ep_mesh: tells an expert module its ``ep`` mesh.
        make_stage: builds a torch pipeline stage (``PipelineStage``).

    Returns:
        This rank's :class:`PipelineStages`.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: the Plan has no pipeline, the mesh's ``pp`` dim does
            not match it, or its schedule cannot run its micro-batch count.
        PlanMismatchError: a stage's Plan does not fit; nothing was changed.

    Example::

        stages = fsdptx.apply_pipeline(manager.plan(model), model, mesh, loss_fn=loss_fn)
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_pipeline: plan must be an fsdptx.Plan, got {type(plan).__name__}")
    require_module(model, "model", "apply_pipeline")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"apply_pipeline: mesh must be a torch DeviceMesh, got {type(mesh).__name__}")
    require_mesh(mesh, shard_module, "apply_pipeline")
    for argument, primitive in (
        ("shard_module", shard_module),
        ("parallelize_module", parallelize_module),
        ("checkpoint_module", checkpoint_module),
        ("hand_ep_mesh", hand_ep_mesh),
        ("make_stage", make_stage),
    ):
        require_callable(primitive, argument, "apply_pipeline")
    if not callable(loss_fn):
        raise TypeError(f"apply_pipeline: loss_fn must be callable (output, target) -> loss, got {type(loss_fn).__name__}")
    if moe_mesh is not None and not isinstance(moe_mesh, DeviceMesh):
        raise TypeError(f"apply_pipeline: moe_mesh must be a torch DeviceMesh or None, got {type(moe_mesh).__name__}")
    pipeline = plan.pipeline
    if pipeline is None:
        raise ValueError("apply_pipeline: the Plan has no pipeline stages; apply it with fsdptx.apply_plan")
    rank = pipeline_coordinate(mesh, pipeline, "apply_pipeline")
    problem = microbatch_problem(pipeline.schedule, pipeline.microbatches, len(pipeline.stages), pipeline.size)
    if problem is not None:
        raise ValueError(f"apply_pipeline: {problem}")
    index = ModelIndex.build(model)
    parts = PipelineParts.from_split(tuple(f for s in pipeline.stages for f in s.modules), pipeline.container)
    missing = [f for f in parts.ordered + parts.spine if f not in index.modules]
    fail([f"pipeline part {f!r} is not a module of {type(model).__name__}" for f in missing])
    local = pipeline.stages_of(rank)
    num = len(pipeline.stages)
    built = []
    for stage in local:
        module = build_stage_module(model, index, parts, stage.modules, stage.index, num)
        stage_index = ModelIndex.build(module)
        resolved, marks, fp32_inputs = checked_units(stage.plan, module, stage_index)
        precheck(stage.plan, module, mesh, stage_index, moe_mesh=moe_mesh, hand_ep_mesh=hand_ep_mesh)
        built.append((stage, module, stage_index, resolved, marks, fp32_inputs))
    modules: list[nn.Module] = []
    torch_stages: list[Any] = []
    group = mesh["pp"].get_group()
    device = _device(mesh)
    for stage, module, stage_index, resolved, marks, fp32_inputs in built:
        apply_resolved(
            stage.plan,
            module,
            mesh,
            resolved,
            marks=marks,
            fp32_inputs=fp32_inputs,
            index=stage_index,
            moe_mesh=moe_mesh,
            shard_module=shard_module,
            parallelize_module=parallelize_module,
            checkpoint_module=checkpoint_module,
            hand_ep_mesh=hand_ep_mesh,
        )
        modules.append(module)
        torch_stages.append(make_stage(module, stage.index, num, device, group=group))
    cls = get_schedule_class(pipeline.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(torch_stages[0], n_microbatches=pipeline.microbatches, loss_fn=loss_fn)
    else:
        schedule = cls(torch_stages, n_microbatches=pipeline.microbatches, loss_fn=loss_fn)
    return PipelineStages(modules, torch_stages, schedule, tuple(s.index for s in local), pipeline)
