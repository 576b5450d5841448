"""A step at another FSDP shard count, from traces at two: every category of
every sample is a fixed part plus a part that goes as one over the shard
count; traces of different steps are refused, not blended."""

from __future__ import annotations

import dataclasses

import pytest

from fsdptx.cli._fit_measure import REFERENCE_SHARDS, shard_points, trace_at
from fsdptx.cli._scaling import at_shard_count
from fsdptx.cli._trace import Collective, Sample, Trace

# (fixed, sharded total) bytes per category of three samples
PARTS = [
    {"sharded_params": (0, 4096), "activations": (1000, 0)},
    {"sharded_params": (0, 4096), "activations": (1000, 8192), "gathered_params": (4096, 0)},
    {"sharded_params": (0, 4096), "temporaries": (64, 16384), "optimizer_state": (0, 8192)},
]


def _trace(shards: int) -> Trace:
    samples = tuple(
        Sample(i, "forward", "layers.0", {k: f + g // shards for k, (f, g) in parts.items()})
        for i, parts in enumerate(PARTS)
    )
    collectives = (Collective(3, "reduce_scatter", "fsdp", "layers.0", "backward", 8192 // shards),)
    return Trace(samples, collectives, activations=1000 + 8192 // shards, batch_seq=(1, 8))


@pytest.mark.parametrize("shards", [1, 8, 16, 64])  # all divide every sharded part: no padding
def test_the_step_at_any_shard_count_follows_from_two(shards: int) -> None:
    derived = at_shard_count(_trace(2), 2, _trace(4), 4, shards)
    want = _trace(shards)
    assert [s.bytes for s in derived.samples] == [s.bytes for s in want.samples]
    assert [c.bytes for c in derived.collectives] == [c.bytes for c in want.collectives]
    assert derived.activations == want.activations


def test_traces_of_different_steps_are_refused() -> None:
    other = _trace(4)
    shorter = dataclasses.replace(other, samples=other.samples[:-1])
    with pytest.raises(ValueError, match="differ .3 and 2 operators"):
        at_shard_count(_trace(2), 2, shorter, 4, 8)
    moved = dataclasses.replace(other, samples=(dataclasses.replace(other.samples[0], phase="backward"), *other.samples[1:]))
    with pytest.raises(ValueError, match="neither stands for 8 shards"):
        at_shard_count(_trace(2), 2, moved, 4, 8)


def test_two_equal_shard_counts_determine_nothing() -> None:
    with pytest.raises(ValueError, match="two distinct shard counts"):
        at_shard_count(_trace(2), 2, _trace(2), 2, 8)


def test_small_shard_counts_are_traced_and_larger_ones_derive_from_the_reference_pair() -> None:
    assert shard_points([1, 2]) == (1, 2)
    assert shard_points([3]) == (3,)
    assert shard_points([16, 1]) == (1, *REFERENCE_SHARDS)
    traced = {s: _trace(s) for s in shard_points([1, 8])}
    assert trace_at(traced, 1) is traced[1]
    assert [s.bytes for s in trace_at(traced, 8).samples] == [s.bytes for s in _trace(8).samples]
