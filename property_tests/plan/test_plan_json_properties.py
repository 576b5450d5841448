"""Plans survive the trip through JSON: ``plan_from_json(plan_to_json(p)) == p``.

Two families of plans: ones planned from random module trees (what real
pipelines produce), and synthetic ones drawn field by field, so that every
kind of value the schema knows (policies, offload policies, int reshard
sizes, every torch ParallelStyle with random layouts, skipped entries,
checkpointing, prefetch chains, marks, exclusions, expert modules) is
covered, not only what planning happens to produce.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

import fsdptx
from fsdptx import Plan, Unit
from fsdptx.plan._types import Checkpointing, CrossBlockRequest, DtypeRequest, Prefetch, TensorParallel, TPAssignment
from fsdptx.testing.strategies import build_module, tree_specs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.int64)

names = st.builds(
    "{}{}{}".format,
    st.sampled_from(["", "layers.", "model.layers."]),
    st.sampled_from(["0", "1", "7", "12"]),
    st.sampled_from(["", ".attn", ".mlp.up_proj", ".sinks", ".norm.weight"]),
)
fqn_tuples = st.lists(names, max_size=4, unique=True).map(tuple)
dtypes = st.sampled_from(DTYPES)
mp_policies = st.none() | st.builds(
    MixedPrecisionPolicy,
    param_dtype=st.none() | dtypes,
    reduce_dtype=st.none() | dtypes,
    output_dtype=st.none() | dtypes,
    cast_forward_inputs=st.booleans(),
)
offloads = st.none() | st.just(OffloadPolicy()) | st.builds(CPUOffloadPolicy, pin_memory=st.booleans())
reshards = st.none() | st.booleans() | st.integers(1, 8)
placements = st.sampled_from([Replicate(), Shard(0), Shard(1), Shard(-1), Partial()])
styles: st.SearchStrategy[ParallelStyle] = st.one_of(
    st.builds(ColwiseParallel, input_layouts=st.none() | placements, output_layouts=st.none() | placements,
              use_local_output=st.booleans()),
    st.builds(RowwiseParallel, input_layouts=st.none() | placements, output_layouts=st.none() | placements,
              use_local_output=st.booleans()),
    st.builds(SequenceParallel, sequence_dim=st.integers(0, 2), use_local_output=st.booleans()),
    st.builds(PrepareModuleInput, input_layouts=st.tuples(placements), desired_input_layouts=st.tuples(placements),
              use_local_output=st.booleans()),
    st.builds(PrepareModuleInput, input_kwarg_layouts=st.fixed_dictionaries({"hidden_states": placements}),
              desired_input_kwarg_layouts=st.fixed_dictionaries({"hidden_states": placements})),
    st.builds(PrepareModuleOutput, output_layouts=placements, desired_output_layouts=placements,
              use_local_output=st.booleans()),
)
units = st.builds(
    Unit,
    modules=fqn_tuples,
    params=fqn_tuples,
    ignored_params=fqn_tuples,
    kind=st.sampled_from(["cross-block", "dtype", "block", "expert", "root"]),
    storage_dtype=st.none() | dtypes,
    compute_dtype=st.none() | dtypes,
    mp_policy=mp_policies,
    offload_policy=offloads,
    reshard_after_forward=reshards,
    numel=st.integers(0, 2**40),
    nbytes=st.integers(0, 2**42),
    mesh=st.sampled_from(["dp", "moe"]),
)
assignments = st.builds(TPAssignment, module=names, style=names, pattern=names, parallel_style=styles)
synthetic_plans = st.builds(
    Plan,
    units=st.lists(units, max_size=4).map(tuple),
    reductions=st.dictionaries(names, st.sampled_from(["mean", "sum"]), max_size=4),
    exclusions=fqn_tuples,
    mp_policy=mp_policies,
    offload_policy=offloads,
    reshard_after_forward=reshards,
    dtype_request=st.none() | st.builds(DtypeRequest, targets=fqn_tuples, fp32_compute_module_names=fqn_tuples,
                                        ignored_params=fqn_tuples, reshard_after_forward=reshards,
                                        always_shard_root=st.booleans()),
    cross_block_requests=st.lists(st.builds(CrossBlockRequest, blocks=fqn_tuples, names=fqn_tuples), max_size=2).map(tuple),
    tensor_parallel=st.none() | st.builds(
        TensorParallel,
        assignments=st.lists(assignments, max_size=4).map(tuple),
        sequence_parallel=st.booleans(),
        skipped=st.lists(st.tuples(names, names, st.text(max_size=20)), max_size=2).map(tuple),
    ),
    checkpointing=st.none() | st.builds(Checkpointing, mode=st.sampled_from(["full", "selective"]), modules=fqn_tuples),
    prefetch=st.lists(st.builds(Prefetch, unit=names, forward=fqn_tuples, backward=fqn_tuples), max_size=3).map(tuple),
    reduce_unused_params=st.booleans(),
    expert_modules=fqn_tuples,
)


def style_descriptions(p: Plan) -> list[str]:
    """What each assignment's torch style is (not part of Plan equality)."""
    tp = p.tensor_parallel
    return [] if tp is None else [f"{type(a.parallel_style).__name__} {vars(a.parallel_style)}" for a in tp.assignments]


@SETTINGS
@given(p=synthetic_plans)
def test_any_plan_reads_back_equal_with_the_same_torch_styles(p: Plan) -> None:
    text = fsdptx.plan_to_json(p)
    back = fsdptx.plan_from_json(text)
    assert back == p
    assert style_descriptions(back) == style_descriptions(p)
    assert fsdptx.plan_to_json(back) == text  # stable: writing again gives the same bytes
    assert not fsdptx.diff_plans(p, back)


@SETTINGS
@given(
    spec=tree_specs(max_ties=0, dtypes=(torch.float32,)),
    policy=st.sampled_from([None, MixedPrecisionPolicy(param_dtype=torch.bfloat16)]),
    reshard=reshards,
)
def test_plans_of_random_models_read_back_equal(
    spec: object, policy: MixedPrecisionPolicy | None, reshard: bool | int | None
) -> None:
    """Single-dtype trees always plan; the plan reads back equal."""
    model = build_module(spec)  # type: ignore[arg-type]
    pipeline = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.mark_reduction, fsdptx.reshard_policy)
    p = fsdptx.plan(model, pipeline, mp_policy=policy, reshard_after_forward=reshard)
    assert p.units
    assert fsdptx.plan_from_json(fsdptx.plan_to_json(p)) == p
