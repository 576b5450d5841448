"""``ShardSeries`` is a fast path of ``at_shard_count`` followed by
``rescale``: for any pair of traces of one step, any shard count and any
target sizes of the sharded parts, it gives the plain path's samples and
peak to the byte."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fsdptx.cli._scaling import ShardSeries, at_shard_count, rescale, traced_steady
from fsdptx.cli._trace import Sample, Trace

KEYS = ("sharded_params", "sharded_grads", "optimizer_state", "activations", "temporaries", "reduce_scatter_buffers")
PHASES = ("forward", "backward", "optimizer")
sizes = st.integers(min_value=0, max_value=10**12)


@st.composite
def trace_pairs(draw: st.DrawFn) -> tuple[Trace, int, Trace, int]:
    """Two traces of one step (same phases and units, any bytes: the
    plain path does not assume they follow f + g / n either)."""
    a_shards, b_shards = draw(st.lists(st.integers(1, 64), min_size=2, max_size=2, unique=True))
    n = draw(st.integers(0, 12))
    phases = draw(st.lists(st.sampled_from(PHASES), min_size=n, max_size=n))
    traces = []
    for _ in range(2):
        samples = tuple(
            Sample(i, phase, f"layers.{i % 3}", draw(st.dictionaries(st.sampled_from(KEYS), sizes, max_size=len(KEYS))))
            for i, phase in enumerate(phases)
        )
        traces.append(Trace(samples, (), activations=0, batch_seq=(1, 8)))
    return traces[0], a_shards, traces[1], b_shards


def _state_growing_to(last: int) -> Trace:
    samples = (Sample(0, "forward", "layers.0", {"optimizer_state": 1}), Sample(1, "forward", "layers.1", {"optimizer_state": last}))
    return Trace(samples, (), activations=0, batch_seq=(1, 8))


@settings(max_examples=300, deadline=None)
@given(pair=trace_pairs(), shards=st.integers(1, 4096), target=st.tuples(sizes, sizes, sizes))
@example(  # a scaled row past int64: the fast path must not wrap around
    pair=(_state_growing_to(999_999_895_576), 1, Trace((Sample(0, "forward", "layers.0", {}), Sample(1, "forward", "layers.1", {})), (), activations=0, batch_seq=(1, 8)), 2),
    shards=1,
    target=(0, 0, 9_223_373),
)
def test_the_series_gives_the_derived_traces_samples_and_rescaled_peak(
    pair: tuple[Trace, int, Trace, int], shards: int, target: tuple[int, int, int]
) -> None:
    a, a_shards, b, b_shards = pair
    series = ShardSeries.of(a, a_shards, b, b_shards)
    derived = at_shard_count(a, a_shards, b, b_shards, shards)
    rows = series.samples(shards).tolist()
    assert [{k: v for k, v in zip(series.keys, row) if v} for row in rows] == [
        {k: v for k, v in s.bytes.items() if v} for s in derived.samples
    ]
    assert series.peak(shards, target) == rescale(derived, traced=traced_steady(derived), target=target)[0]


@settings(max_examples=100, deadline=None)
@given(pair=trace_pairs())
def test_a_series_sent_between_processes_arrives_with_the_same_matrices(pair: tuple[Trace, int, Trace, int]) -> None:
    import pickle

    import torch

    series = ShardSeries.of(*pair)
    sent = pickle.loads(pickle.dumps(series))
    assert (sent.a_shards, sent.b_shards, sent.keys) == (series.a_shards, series.b_shards, series.keys)
    for name in ("a", "b", "before_optimizer"):
        assert torch.equal(getattr(sent, name), getattr(series, name)), name
