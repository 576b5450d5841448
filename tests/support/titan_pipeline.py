"""A Titan-laid-out model split into pipeline stages by hand, in torchtitan's
pattern: the baseline fsdptx's pipeline parallelism is compared with (losses
and collectives per step).

torchtitan 0.2.2's ``pipeline_llm``: per stage a deep copy of the model with
the other stages' modules removed (blocks deleted from the ``layers``
ModuleDict; the embedding, norm and head replaced by ``nn.Identity`` here,
since the preset's ``forward`` calls them, where torchtitan sets them to
``None`` and tests for it), a ``PipelineStage`` per copy, then
``apply_fsdp``: ``fully_shard`` over the dp mesh on the embedding, each
block, norm and head together and the stage root, never resharding after
forward (torchtitan's default under pipeline parallelism), and torch's
schedule from ``get_schedule_class``. Stages are placed in a loop (stage
``i`` on pp rank ``i % pp``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from fsdptx.presets import Titan


def pipeline_by_hand(
    model: Titan,
    mesh: DeviceMesh,
    split: Sequence[Sequence[str]],
    schedule: str,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[list[nn.Module], list[PipelineStage], Any]:
    """This pp rank's stage modules, their ``PipelineStage`` objects and the
    schedule driving them. ``split`` lists each stage's module FQNs (the
    ``module_fqns_per_model_part`` of torchtitan); ``mesh`` has ``pp`` and
    ``dp`` dims. ``model`` is copied, never changed."""
    pp, dp = mesh["pp"], mesh["dp"]
    rank, size = pp.get_local_rank(), pp.size()
    modules: list[nn.Module] = []
    stages: list[PipelineStage] = []
    for index in range(rank, len(split), size):
        part = copy.deepcopy(model)
        keep = set(split[index])
        for name in list(part.layers.keys()):
            if f"layers.{name}" not in keep:
                del part.layers[name]
        for name in ("tok_embeddings", "norm", "output"):
            if name not in keep:
                setattr(part, name, nn.Identity())
        if "tok_embeddings" in keep:
            fully_shard(part.tok_embeddings, mesh=dp, reshard_after_forward=False)
        for block in part.layers.values():
            fully_shard(block, mesh=dp, reshard_after_forward=False)
        if "output" in keep:
            fully_shard([part.norm, part.output], mesh=dp, reshard_after_forward=False)
        fully_shard(part, mesh=dp)
        modules.append(part)
        stages.append(PipelineStage(part, index, len(split), torch.device("cpu"), group=pp.get_group()))
    cls = get_schedule_class(schedule)
    first: Any = stages[0] if issubclass(cls, PipelineScheduleSingle) else stages
    return modules, stages, cls(first, n_microbatches=microbatches, loss_fn=loss_fn)
