"""Rank stability of parameter order and of plans.

Invariant: every rank of a job builds "the same logical model", but nothing
guarantees that ranks register children, parameters and buffers in the same
order (models assembled from dicts, conditional construction, pipeline stages
rebuilt by hand). Whatever a rank's registration order:

(a) ``iter_unique_named_parameters`` yields the same FQN sequence on every
    rank (the order TP-replica collectives are issued in), and
(b) ``fsdptx.plan`` returns an equal ``Plan`` on every rank, so every rank
    shards the same modules into the same units with the same policies and
    issues the same FSDP collectives.

Each rank is simulated one at a time on ``fake_mesh((4,), ("dp",), rank=r)``
and builds the tree with its own shuffle seed.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.distributed.fsdp import MixedPrecisionPolicy

import fsdptx
from fsdptx import Plan, PlanningError
from fsdptx.testing import fake_mesh
from fsdptx.testing.strategies import (
    ModuleSpec,
    TensorSpec,
    TreeSpec,
    build_module,
    tree_specs,
)

WORLD = 4
BF16, FP32 = torch.bfloat16, torch.float32
POLICIES = (None, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32))
PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks, fsdptx.mark_reduction)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def leafy(spec: ModuleSpec) -> ModuleSpec:
    """Parameters only on leaves, each leaf dtype-uniform: planning always succeeds."""
    if spec.children:
        return dataclasses.replace(spec, params=(), children=tuple((n, leafy(c)) for n, c in spec.children))
    kept = tuple(p for p in spec.params if p.dtype == spec.params[0].dtype) if spec.params else ()
    return dataclasses.replace(spec, params=kept)


# Leaf-only trees (always plannable) and arbitrary untied trees (plannable or not).
trees = st.one_of(tree_specs(max_ties=0).map(lambda t: TreeSpec(leafy(t.root))), tree_specs(max_ties=0))
seeds = st.lists(st.integers(0, 2**16), min_size=WORLD, max_size=WORLD)

# Two leaves of different dtypes with one parameter each: a 2-group tie. Seeds
# 0 and 1 register the leaves in opposite orders.
_TIE = TreeSpec(
    ModuleSpec(
        params=(),
        buffers=(),
        children=(
            ("m0", ModuleSpec(params=(TensorSpec("w0", (2,), FP32),), buffers=(), children=())),
            ("m1", ModuleSpec(params=(TensorSpec("w0", (2,), BF16),), buffers=(), children=())),
        ),
    )
)


def per_rank(spec: TreeSpec, rank_seeds: list[int], fn):  # type: ignore[no-untyped-def]
    """``fn(model)`` on each fake rank in turn, the model built with that rank's seed."""
    out = []
    for rank, seed in enumerate(rank_seeds):
        with fake_mesh((WORLD,), ("dp",), rank=rank):
            out.append(fn(build_module(spec, shuffle_seed=seed)))
    return out


@SETTINGS
@given(spec=trees, rank_seeds=seeds)
def test_unique_parameter_order_is_the_same_on_every_rank(spec: TreeSpec, rank_seeds: list[int]) -> None:
    orders = per_rank(spec, rank_seeds, lambda m: [f for f, _ in fsdptx.iter_unique_named_parameters(m)])
    assert all(order == orders[0] for order in orders), orders
    assert orders[0] == sorted(spec.param_fqns())  # no ties: every FQN, in plain string order


def _plan_or_error(mp_policy: MixedPrecisionPolicy | None):  # type: ignore[no-untyped-def]
    def run(model: torch.nn.Module) -> Plan | type[PlanningError]:
        try:
            return fsdptx.plan(model, PIPELINE, mp_policy=mp_policy)
        except PlanningError:
            return PlanningError

    return run


@SETTINGS
@given(spec=trees, rank_seeds=seeds, mp_policy=st.sampled_from(POLICIES))
@example(spec=_TIE, rank_seeds=[0, 1, 0, 1], mp_policy=None)
def test_plan_is_the_same_on_every_rank(
    spec: TreeSpec, rank_seeds: list[int], mp_policy: MixedPrecisionPolicy | None
) -> None:
    plans = per_rank(spec, rank_seeds, _plan_or_error(mp_policy))
    # Planning succeeds on every rank or fails on every rank ...
    assert all((p is PlanningError) == (plans[0] is PlanningError) for p in plans), plans
    # ... and when it succeeds, every rank gets an equal Plan.
    assert all(p == plans[0] for p in plans), "\n\n".join(str(p) for p in plans)
