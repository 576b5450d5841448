"""Expert parallelism inside pipeline stages of a stack that opens with
dense blocks (DeepSeek-V3: dense MLPs first, MoE after): a stage holding
only dense blocks plans and applies no expert split, the stages holding
experts split theirs over ``ep``; a whole model (not a stage) planned
without the split is still refused on an ``ep`` mesh, since every ep rank
would train every expert on its own tokens."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
import hf_zoo
from fsdptx.testing import fake_mesh

CONFIG = fsdptx.FSDP2Config(pipeline_parallel=fsdptx.PipelineParallelConfig(microbatches=2))
EXPERTS = "model.layers.1.mlp.experts"  # hf_zoo's DeepSeek-V3: layer 0 dense, layer 1 MoE of 4 experts


def test_a_dense_stage_plans_no_expert_split_and_the_moe_stage_splits_its_experts() -> None:
    model = hf_zoo.deepseek_v3()
    with fake_mesh((2, 2), ("pp", "dp_shard")) as mesh:
        moe = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_shard", "ep"))
        p = fsdptx.FSDP2Manager(CONFIG, mesh, moe_mesh=moe).plan(model)
    assert p.pipeline is not None
    dense, sparse = p.pipeline.stages
    assert "model.layers.0" in dense.modules and dense.plan.expert_parallel is None
    assert sparse.plan.expert_parallel is not None and sparse.plan.expert_parallel.modules == (EXPERTS,)


@pytest.mark.parametrize(("rank", "stage"), [(0, 0), (2, 1)])
def test_each_rank_parallelizes_its_stage_and_only_the_moe_stage_splits_experts(rank: int, stage: int) -> None:
    model = hf_zoo.deepseek_v3()
    with fake_mesh((2, 2), ("pp", "dp_shard"), rank=rank) as mesh:
        moe = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp_shard", "ep"))
        stages = fsdptx.FSDP2Manager(CONFIG, mesh, moe_mesh=moe).parallelize(model, loss_fn=F.cross_entropy)
        assert stages.indices == (stage,)
        (module,) = stages.modules
        split = {
            n: p.to_local().shape[0]
            for n, p in module.named_parameters()
            if n.startswith(EXPERTS) and isinstance(p, DTensor)
        }
    if stage == 0:
        assert split == {}
    else:
        assert split and all(rows == 2 for rows in split.values()), split  # 4 experts over ep=2


def test_a_whole_model_planned_without_the_expert_split_is_refused_on_an_ep_mesh() -> None:
    model = hf_zoo.deepseek_v3()
    with fake_mesh((2,), ("dp_shard",)) as mesh:
        moe = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "ep"))
        p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks))
        with pytest.raises(fsdptx.PlanMismatchError, match="does not split experts across it"):
            fsdptx.apply_plan(p, model, mesh, moe_mesh=moe)
