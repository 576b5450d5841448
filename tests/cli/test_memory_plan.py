"""The memory plan agrees with torch's FSDPMemTracker run the plain way.

The reference is torchtitan's estimation recipe written out here: parallelize
the meta model, materialize it in ``FakeTensorMode``, run two training
iterations under ``FSDPMemTracker`` (the first creates AdamW's state) and
read the tracker's own snapshots. ``fsdptx.estimate_memory`` must land
within the issue's targets: params, grads and optimizer state within 1%,
activations within 15%, peak within -10%/+15%.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

import fsdptx
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

from tracker_recipe import Reference, tracker_reference

SEQ = 256
LAYERS = 2
CASES = {
    "dp4-ac-off": ((4,), ("dp",), FSDP2Config()),
    "dp4-ac-full": ((4,), ("dp",), FSDP2Config(activation_checkpointing="full")),
    "dp2xtp2-sp": ((2, 2), ("dp", "tp"), FSDP2Config(sequence_parallel=True)),
}


def planned(shape: Sequence[int], names: Sequence[str], config: FSDP2Config) -> fsdptx.MemoryEstimate:
    with torch.device("meta"):
        model = build_preset("llama", LAYERS)
    with fake_mesh(shape, names) as mesh:
        return fsdptx.estimate_memory(FSDP2Manager(config, mesh), model, batch=1, seq=SEQ)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[fsdptx.MemoryEstimate, Reference]:
    shape, names, config = CASES[request.param]
    return planned(shape, names, config), tracker_reference(LAYERS, SEQ, shape, names, config)


def within(value: int, reference: int, low: float, high: float) -> bool:
    return reference * (1 + low) <= value <= reference * (1 + high)


def test_params_grads_and_optimizer_state_are_within_one_percent(
    case: tuple[fsdptx.MemoryEstimate, Reference],
) -> None:
    plan, ref = case
    assert within(plan.params_bytes, ref.params, -0.01, 0.01), (plan.params_bytes, ref.params)
    assert within(plan.grads_bytes, ref.grads, -0.01, 0.01), (plan.grads_bytes, ref.grads)
    assert within(plan.optimizer_bytes, ref.optimizer, -0.01, 0.01), (plan.optimizer_bytes, ref.optimizer)


def test_activations_are_within_fifteen_percent(case: tuple[fsdptx.MemoryEstimate, Reference]) -> None:
    plan, ref = case
    assert within(plan.activations_bytes, ref.activations, -0.15, 0.15), (plan.activations_bytes, ref.activations)


def test_peak_is_within_minus_ten_plus_fifteen_percent(case: tuple[fsdptx.MemoryEstimate, Reference]) -> None:
    plan, ref = case
    assert within(plan.peak_bytes, ref.peak, -0.10, 0.15), (plan.peak_bytes, ref.peak)


def test_full_checkpointing_saves_less_and_never_peaks_higher() -> None:
    off = planned((4,), ("dp",), FSDP2Config())
    full = planned((4,), ("dp",), FSDP2Config(activation_checkpointing="full"))
    assert full.activations_bytes < off.activations_bytes
    assert full.peak_bytes <= off.peak_bytes


def test_the_peak_says_where_it_happens_and_its_parts_add_up() -> None:
    plan = planned((4,), ("dp",), FSDP2Config())
    assert plan.peak_at.startswith(("forward of ", "backward of ", "optimizer step"))
    assert sum(plan.peak_breakdown.values()) == plan.peak_bytes
    # The trace also holds AdamW's step counters (one fp32 scalar per
    # parameter), which the exact shard-size optimizer figure leaves out.
    step_counters = 4 * sum(1 for _ in build_preset("llama", LAYERS).parameters())
    assert 0 <= max(s.total for s in plan.timeline) - plan.peak_bytes <= step_counters


def test_fsdp_collectives_are_traced_per_unit() -> None:
    plan = planned((4,), ("dp",), FSDP2Config())
    ops = {(c.source, c.op) for c in plan.collectives}
    assert {("fsdp", "all_gather"), ("fsdp", "reduce_scatter")} <= ops


def test_a_model_that_is_not_on_the_meta_device_is_refused() -> None:
    model = build_preset("llama", 1)
    with fake_mesh((2,), ("dp",)) as mesh, pytest.raises(ValueError, match="meta device"):
        fsdptx.estimate_memory(FSDP2Manager(FSDP2Config(), mesh), model, batch=1, seq=8)
