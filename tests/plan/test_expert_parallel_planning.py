"""An ``ep`` size that does not divide an expert count is refused when the
plan is made (``expert_parallel(ep=...)``, ``FSDP2Manager.plan``), not
only when it is applied: a dry run that accepts what the run refuses
would mislead."""

from __future__ import annotations

import functools

import pytest
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.testing import fake_mesh
from moe_ep_model import EXPERTS, build
from unchanged import assert_unchanged, state_of

assert EXPERTS == 4


def pipeline(ep: int | None) -> fsdptx.Transform:
    return fsdptx.compose(fsdptx.shard_by_dtype, functools.partial(fsdptx.expert_parallel, ep=ep))


def test_an_ep_size_that_does_not_divide_the_expert_count_is_refused_at_planning() -> None:
    model = build()
    before = state_of(model)
    with pytest.raises(
        fsdptx.PlanningError,
        match=r"expert_parallel: expert modules 'layers\.0\.experts \(4 experts\)', 'layers\.1\.experts \(4 experts\)' "
        r"cannot be split evenly across ep=3; use an ep size that divides the expert count",
    ):
        fsdptx.plan(model, pipeline(3))
    assert_unchanged(before, state_of(model))


@pytest.mark.parametrize("ep", [None, 1, 2, 4])
def test_an_ep_size_that_divides_the_expert_count_or_none_plans(ep: int | None) -> None:
    p = fsdptx.plan(build(), pipeline(ep))
    assert p.expert_parallel is not None and p.expert_parallel.num_experts == (4, 4)


@pytest.mark.parametrize(("ep", "error"), [("2", TypeError), (True, TypeError), (0, ValueError)])
def test_an_ep_that_is_not_a_positive_int_is_refused_naming_it(ep: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="expert_parallel: ep must be"):
        fsdptx.plan(build(), pipeline(ep))  # type: ignore[arg-type]


def test_the_managers_dry_run_refuses_the_moe_mesh_its_run_would_refuse() -> None:
    model = build()
    before = state_of(model)
    with fake_mesh((6,), ("dp",)) as mesh:
        moe_mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp_shard", "ep"))
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh, moe_mesh=moe_mesh)
        with pytest.raises(fsdptx.PlanningError, match=r"\(4 experts\)'.*cannot be split evenly across ep=3"):
            manager.plan(model)
    assert_unchanged(before, state_of(model))
