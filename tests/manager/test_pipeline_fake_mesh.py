"""``FSDP2Manager`` with pipeline parallelism on fake meshes (one process
plays any rank): the Plan holds every stage and its units, stages do not
reshard after forward unless the config says so, and ``parallelize`` builds
exactly the stages the Plan gives this rank, named by the whole model's
FQNs, with the FSDP state and TP layouts the stage Plans say."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager, PipelineParallelConfig, Plan
from fsdptx.presets import Decoder, DecoderConfig, titan
from fsdptx.testing import fake_mesh
from two_kinds import stack
from unchanged import assert_unchanged, state_of


def _decoder(layers: int = 4, device: str = "cpu") -> Decoder:
    torch.manual_seed(0)
    with torch.device(device):
        return Decoder(DecoderConfig(vocab=32, dim=16, hidden=32, layers=layers))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _plan(model: nn.Module, shape: tuple[int, ...] = (2, 2), names: tuple[str, ...] = ("pp", "dp"), **config: Any) -> Plan:
    pipeline = config.pop("pipeline", {})
    with fake_mesh(shape, names) as mesh:
        return FSDP2Manager(FSDP2Config(pipeline_parallel=PipelineParallelConfig(**pipeline), **config), mesh).plan(model)


def _stage_units(planned: Plan) -> list[Any]:
    assert planned.pipeline is not None
    return [u for s in planned.pipeline.stages for u in s.plan.units]


def test_stages_do_not_reshard_after_forward_and_chain_no_prefetch() -> None:
    planned = _plan(_decoder(), pipeline={"microbatches": 4})
    assert planned.pipeline is not None
    assert {u.reshard_after_forward for u in _stage_units(planned)} == {False}
    assert all(s.plan.prefetch == () for s in planned.pipeline.stages)


@pytest.mark.parametrize("explicit", [True, False])
def test_an_explicit_reshard_after_forward_in_the_config_wins_under_pipeline_parallelism(explicit: bool) -> None:
    planned = _plan(_decoder(), reshard_after_forward=explicit)
    units = _stage_units(planned)
    assert units and {u.reshard_after_forward for u in units} == {explicit}


def test_planning_a_pipeline_leaves_the_model_as_it_was() -> None:
    model = _decoder()
    before = state_of(model)
    _plan(model, (2, 2, 2), ("pp", "dp", "tp"), sequence_parallel=True, activation_checkpointing="full")
    assert_unchanged(before, state_of(model))


def _reshard_flags(module: nn.Module) -> dict[str, bool]:
    """FSDP2 keeps a post-forward mesh exactly when a unit reshards (read
    before the first forward). A unit without parameters (the root of a
    middle stage, which only drives its blocks' units) has no group."""
    flags = {}
    for fqn, m in module.named_modules():
        if isinstance(m, FSDPModule):
            group = fully_shard.state(m)._fsdp_param_group
            if group is not None:
                flags[fqn] = group.post_forward_mesh_info is not None
    return flags


@pytest.mark.parametrize(
    ("pipeline", "rank", "indices"),
    [
        ({"microbatches": 2}, 0, (0,)),
        ({"microbatches": 2}, 3, (1,)),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 2}, 1, (0, 2)),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 2}, 2, (1, 3)),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 2, "microbatches": 2}, 0, (0, 3)),
    ],
)
def test_parallelize_builds_this_ranks_stages_as_the_plan_says(pipeline: dict[str, Any], rank: int, indices: tuple[int, ...]) -> None:
    config = FSDP2Config(mp_policy=None, pipeline_parallel=PipelineParallelConfig(**pipeline))
    planned = _plan(_decoder(), mp_policy=None, pipeline=dict(pipeline))
    assert planned.pipeline is not None
    model = _decoder()
    whole = dict(model.named_parameters())
    with fake_mesh((2, 2), ("pp", "dp"), rank=rank) as mesh:
        stages = FSDP2Manager(config, mesh).parallelize(model, loss_fn=loss_fn)
        assert isinstance(stages, fsdptx.PipelineStages)
        assert stages.indices == indices
        assert stages.is_first == (0 in indices)
        assert stages.is_last == (len(planned.pipeline.stages) - 1 in indices)
        assert len(stages) == len(indices) and len(stages.stages) == len(indices)
        for module, index in zip(stages, indices):
            stage = planned.pipeline.stages[index]
            names = {n for n, _ in module.named_parameters()}
            assert names == {p for u in stage.plan.units for p in u.params}
            assert names <= whole.keys()
            assert set(module.state_dict()) == names  # checkpoint keys are the whole model's
            # the stage holds the model's own modules (sharded in place), not copies
            assert all(module.get_submodule(m) is model.get_submodule(m) for m in stage.modules)
            assert _reshard_flags(module) == {u.modules[0]: u.reshard_after_forward for u in stage.plan.units if u.params}
            assert isinstance(module, FSDPModule)  # the stage root is a unit, with or without parameters
            for _, p in module.named_parameters():
                assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.mesh_dim_names == ("dp",)


def test_the_stages_of_all_ranks_hold_every_parameter_once() -> None:
    config = FSDP2Config(mp_policy=None, pipeline_parallel=PipelineParallelConfig(microbatches=2))
    held: list[str] = []
    for rank in (0, 2):  # one rank per pipeline coordinate
        with fake_mesh((2, 2), ("pp", "dp"), rank=rank) as mesh:
            stages = FSDP2Manager(config, mesh).parallelize(_decoder(), loss_fn=loss_fn)
            held += [n for m in stages for n, _ in m.named_parameters()]
    assert sorted(held) == sorted(n for n, _ in _decoder().named_parameters())


def test_tensor_parallel_stages_shard_their_own_blocks_on_the_tp_dim() -> None:
    config = FSDP2Config(mp_policy=None, sequence_parallel=True, pipeline_parallel=PipelineParallelConfig(microbatches=2))
    planned = _plan(_decoder(), (2, 1, 2), ("pp", "dp", "tp"), mp_policy=None, sequence_parallel=True, pipeline={"microbatches": 2})
    assert planned.pipeline is not None
    assert all(s.plan.tensor_parallel is not None for s in planned.pipeline.stages)
    with fake_mesh((2, 1, 2), ("pp", "dp", "tp"), rank=2) as mesh:
        stages = FSDP2Manager(config, mesh).parallelize(_decoder(), loss_fn=loss_fn)
        assert isinstance(stages, fsdptx.PipelineStages) and stages.indices == (1,)
        params = dict(stages[0].named_parameters())
        assert set(n.split(".")[0] + "." + n.split(".")[1] for n in params if n.startswith("layers.")) == {"layers.2", "layers.3"}
        q = params["layers.2.attn.q_proj.weight"]
        assert isinstance(q, DTensor) and "tp" in (q.device_mesh.mesh_dim_names or ())
        tp_dim = q.device_mesh.mesh_dim_names.index("tp")  # type: ignore[union-attr]
        assert q.placements[tp_dim] == Shard(0)


def test_the_torchtitan_preset_plans_per_stage_as_shipped() -> None:
    with torch.device("meta"):
        model = titan(layers=4)
    planned = _plan(model, pipeline={"microbatches": 2})
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == [
        ("tok_embeddings", "layers.0", "layers.1"),
        ("layers.2", "layers.3", "norm", "output"),
    ]
    # the default policy computes the fp32 master weights in bf16
    assert {u.compute_dtype for u in _stage_units(planned)} == {torch.bfloat16}


@pytest.mark.parametrize("build", [titan, None], ids=["titan", "decoder"])
def test_a_stage_holding_one_block_plans_it_as_a_block_without_a_warning(build: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Interleaved over 4 layers on pp=2 gives 4 stages of one block each: no
    container rule finds a block among one child, so each stage is told the
    blocks the whole model has."""
    if build is None:
        model: nn.Module = _decoder(device="meta")
    else:
        with torch.device("meta"):
            model = build(layers=4)
    with caplog.at_level("WARNING"):
        planned = _plan(model, pipeline={"schedule": "Interleaved1F1B", "stages_per_rank": 2, "microbatches": 4})
    assert planned.pipeline is not None and len(planned.pipeline.stages) == 4
    for layer, stage in enumerate(planned.pipeline.stages):
        blocks = [u.modules for u in stage.plan.units if u.kind == "block"]
        assert blocks == [(f"layers.{layer}",)], (stage.index, stage.plan.units)
        assert not any("no blocks" in w for w in stage.plan.warnings)
    assert not [r.getMessage() for r in caplog.records if "no blocks" in r.getMessage()]


def test_a_hugging_face_llama_plans_per_stage_as_shipped() -> None:
    pytest.importorskip("transformers")
    import hf_zoo

    model = hf_zoo.llama()
    planned = _plan(model, (2, 1, 2), ("pp", "dp", "tp"), pipeline={"microbatches": 2})
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == [
        ("model.embed_tokens", "model.layers.0"),
        ("model.layers.1", "model.norm", "lm_head"),
    ]
    first, last = (s.plan.tensor_parallel for s in planned.pipeline.stages)
    assert first is not None and last is not None
    assert str(first) != str(last)  # each stage's TP plan covers its own modules
    assert {u.kind for u in _stage_units(planned)} == {"block", "root"}


@pytest.mark.parametrize("kinds", ["DSDS", "DDSS"], ids=["alternating", "dense first"])
@pytest.mark.parametrize("blocks", [["DenseBlock", "SparseBlock"], ["SparseBlock", "DenseBlock"]], ids=["D, S", "S, D"])
def test_blocks_of_two_classes_plan_and_parallelize_stages_in_forward_order(kinds: str, blocks: list[str]) -> None:
    """Named in any order, the blocks are split in the model's order, and a
    stage holding no block of one named class plans and applies as well."""
    config = FSDP2Config(mp_policy=None, blocks=blocks, pipeline_parallel=PipelineParallelConfig(microbatches=2))
    held = [("emb", "layers.0", "layers.1"), ("layers.2", "layers.3", "head")]
    planned = _plan(stack(kinds, device="meta"), mp_policy=None, blocks=blocks, pipeline={"microbatches": 2})
    assert planned.pipeline is not None
    assert [s.modules for s in planned.pipeline.stages] == held
    assert [{u.modules for u in s.plan.units if u.kind == "block"} for s in planned.pipeline.stages] == [
        {("layers.0",), ("layers.1",)},
        {("layers.2",), ("layers.3",)},
    ]
    for rank, index in ((0, 0), (2, 1)):  # one rank per pipeline coordinate
        model = stack(kinds)
        with fake_mesh((2, 2), ("pp", "dp"), rank=rank) as mesh:
            stages = FSDP2Manager(config, mesh).parallelize(model, loss_fn=loss_fn)
            assert isinstance(stages, fsdptx.PipelineStages) and stages.indices == (index,)
            module = stages[0]
            blocks_held = [f"layers.{n}" for n in module.get_submodule("layers")._modules]
            assert blocks_held == [m for m in held[index] if m.startswith("layers.")]  # in the order they run
            assert all(module.get_submodule(m) is model.get_submodule(m) for m in held[index])
            names = {n for n, _ in module.named_parameters()}
            assert names == {p for u in planned.pipeline.stages[index].plan.units for p in u.params}
            assert all(isinstance(p, DTensor) for _, p in module.named_parameters())


@pytest.mark.parametrize(
    ("pp", "stages_per_rank", "microbatches"),
    [(2, 2, 4), (2, 2, 2), (2, 3, 4), (4, 2, 8), (4, 2, 4), (2, 2, 6), (4, 2, 3), (2, 4, 8)],
)
def test_each_ranks_interleaved_1f1b_order_is_the_one_torchs_schedule_runs(
    pp: int, stages_per_rank: int, microbatches: int
) -> None:
    """``interleaved_1f1b_actions``, which ``--fit`` walks to count a rank's
    activations in flight, against the ``pipeline_order`` torch's
    ``ScheduleInterleaved1F1B`` computes for the stages ``parallelize`` builds."""
    from fsdptx.plan._stages import interleaved_1f1b_actions

    config = FSDP2Config(
        pipeline_parallel=PipelineParallelConfig(
            schedule="Interleaved1F1B", microbatches=microbatches, stages_per_rank=stages_per_rank
        )
    )
    with fake_mesh((pp,), ("pp",)) as mesh:
        stages = FSDP2Manager(config, mesh).parallelize(_decoder(pp * stages_per_rank, "meta"), loss_fn=loss_fn)
        assert not isinstance(stages, nn.Module)
        for rank in range(pp):
            theirs = tuple(
                ("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index, a.microbatch_index)
                for a in stages.schedule.pipeline_order[rank]
                if a is not None
            )
            assert interleaved_1f1b_actions(rank, pp, stages_per_rank, microbatches) == theirs
