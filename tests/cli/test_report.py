"""``step_traffic`` predicts the collectives FSDP2 really issues.

Each measuring test plans a small mixed-dtype decoder with the CLI's default
pipeline, applies the plan with the real ``fully_shard`` on a two-rank fake
mesh, runs forward+backward on random tokens while recording collectives, and
compares the counts with the prediction made from the Plan alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdptx import apply_plan
from fsdptx.cli._main import DEFAULT_PIPELINE
from fsdptx.plan._plan import Plan
from fsdptx.cli._report import UnitTraffic, step_traffic
from fsdptx.plan._compose import plan
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import Collective, fake_mesh, record_collectives

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
POLICIES = pytest.mark.parametrize("mp", [BF16_POLICY, None], ids=["bf16", "mp-none"])
VOCAB = 32


# --------------------------------------------------------------------------- helpers


def make_decoder(*, sibling_dtype: torch.dtype | None = torch.bfloat16) -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab=VOCAB, dim=16, hidden=32, layers=3, fp32_holders=True, sibling_dtype=sibling_dtype)
    return Decoder(cfg)


def measure(model: Decoder, p: Plan, *, steps: int = 1, world: int = 2) -> list[Collective]:
    """Apply ``p`` with ``fully_shard`` on a fake mesh, run ``steps``
    forward+backward passes, and return the collectives they issued."""
    with fake_mesh((world,), ("dp",)) as mesh:
        apply_plan(p, model, mesh)
        tokens = torch.randint(0, VOCAB, (2, 5))
        with record_collectives() as calls:
            for _ in range(steps):
                model(tokens).float().sum().backward()
    return calls


def all_gathers(calls: list[Collective]) -> list[Collective]:
    return [c for c in calls if "allgather" in c.op or "all_gather" in c.op]


def reduce_scatters(calls: list[Collective]) -> list[Collective]:
    return [c for c in calls if "reduce_scatter" in c.op]


def predicted(p: Plan) -> tuple[int, int]:
    traffic = step_traffic(p)
    return sum(t.all_gathers for t in traffic), sum(t.reduce_scatters for t in traffic)


def traffic_by_kind(p: Plan) -> dict[str, set[UnitTraffic]]:
    out: dict[str, set[UnitTraffic]] = {}
    for unit, t in zip(p.units, step_traffic(p)):
        out.setdefault(unit.kind, set()).add(t)
    return out


# --------------------------------------------------------------------------- measured against FSDP2


@POLICIES
def test_predicted_all_gathers_match_fsdp(mp: MixedPrecisionPolicy | None) -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=mp)
    gathers, _ = predicted(p)
    assert gathers == 14  # root 1, cross-block sinks 1, 3 blocks and 3 gates 2 each
    assert len(all_gathers(measure(model, p))) == gathers


@POLICIES
def test_predicted_reduce_scatters_match_fsdp(mp: MixedPrecisionPolicy | None) -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=mp)
    _, scatters = predicted(p)
    assert scatters == len(p.units) == 8
    assert len(reduce_scatters(measure(model, p))) == scatters


def test_prediction_holds_for_every_step() -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    calls = measure(model, p, steps=2)
    assert (len(all_gathers(calls)), len(reduce_scatters(calls))) == tuple(2 * n for n in predicted(p))


def test_reshard_after_forward_false_gathers_once_per_unit() -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=BF16_POLICY, reshard_after_forward=False)
    assert predicted(p) == (len(p.units), len(p.units))
    calls = measure(model, p)
    assert (len(all_gathers(calls)), len(reduce_scatters(calls))) == predicted(p)


def test_explicit_reshard_true_also_reshards_the_root() -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=BF16_POLICY, reshard_after_forward=True)
    calls = measure(model, p)
    assert len(all_gathers(calls)) == predicted(p)[0] == 15


def test_reshard_after_forward_int_one_means_no_reshard() -> None:
    # FSDP2 turns reshard_after_forward=1 (reshard to a group of one) into False.
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=BF16_POLICY, reshard_after_forward=1)
    calls = measure(model, p)
    assert len(all_gathers(calls)) == predicted(p)[0] == 8


def test_reshard_after_forward_int_below_world_reshards() -> None:
    model = make_decoder()
    p = plan(model, DEFAULT_PIPELINE, mp_policy=BF16_POLICY, reshard_after_forward=2)
    calls = measure(model, p, world=4)
    assert len(all_gathers(calls)) == predicted(p)[0] == 15


@POLICIES
def test_predicted_bytes_match_fsdp_when_nothing_is_padded(mp: MixedPrecisionPolicy | None) -> None:
    # Without the (1, dim) gates every dim-0 is even, so FSDP pads nothing on
    # two ranks and the gathered/reduced sizes are exactly the unsharded ones.
    model = make_decoder(sibling_dtype=None)
    p = plan(model, DEFAULT_PIPELINE, mp_policy=mp)
    traffic = step_traffic(p)
    calls = measure(model, p)
    # _allgather_base_(output, input); _reduce_scatter_base_(output, input)
    gathered = sum(c.shapes[0][0] * c.dtypes[0].itemsize for c in all_gathers(calls))
    reduced = sum(c.shapes[1][0] * c.dtypes[1].itemsize for c in reduce_scatters(calls))
    assert gathered == sum(t.all_gather_bytes for t in traffic)
    assert reduced == sum(t.reduce_scatter_bytes for t in traffic)


# --------------------------------------------------------------------------- the prediction itself (pure)


def test_root_and_cross_block_units_gather_once_others_twice() -> None:
    p = plan(make_decoder(), DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    by_kind = {kind: {t.all_gathers for t in ts} for kind, ts in traffic_by_kind(p).items()}
    assert by_kind == {"root": {1}, "cross-block": {1}, "block": {2}, "dtype": {2}}


def test_every_unit_with_parameters_reduce_scatters_once() -> None:
    p = plan(make_decoder(), DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    assert [t.reduce_scatters for t in step_traffic(p)] == [1] * len(p.units)


def test_gather_bytes_use_the_compute_dtype() -> None:
    p = plan(make_decoder(), DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    for unit, t in zip(p.units, step_traffic(p)):
        assert unit.compute_dtype is not None
        assert t.all_gather_bytes == t.all_gathers * unit.numel * unit.compute_dtype.itemsize


def test_reduce_bytes_use_the_policy_reduce_dtype() -> None:
    p = plan(make_decoder(), DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    assert [t.reduce_scatter_bytes for t in step_traffic(p)] == [4 * u.numel for u in p.units]


def test_unit_without_parameters_issues_nothing() -> None:
    p = plan(make_decoder(), DEFAULT_PIPELINE, mp_policy=BF16_POLICY)
    empty = p.replace(units=(dataclasses.replace(p.units[0], params=(), numel=0, nbytes=0),))
    assert step_traffic(empty) == (UnitTraffic(0, 0, 0, 0),)
