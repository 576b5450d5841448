"""The traced step does not track fake tensors' device queries.

Fake tensors answer C++'s ``device()`` through dispatch, so the tracker
sees a ``prim.device`` call for most operators a step runs. None of them
allocates, so the trace passes them through untracked; the step it records
must be the one the plain tracker records when it tracks them too.
"""

from __future__ import annotations

import pytest
import torch

from fsdptx.cli import _trace
from fsdptx.cli._run import dry_run
from fsdptx.cli._trace import Trace
from fsdptx.manager import FSDP2Config
from fsdptx.presets import build_preset


def _step(config: FSDP2Config, shape: tuple[int, ...], names: tuple[str, ...]) -> Trace:
    with torch.device("meta"):
        model = build_preset("llama", 2)
    trace = dry_run(model, shape, names, config, batch_seq=(1, 128)).trace
    assert trace is not None
    return trace


def _peak(trace: Trace) -> tuple[int, str, str]:
    totals = [sum(s.bytes.values()) for s in trace.samples]
    at = trace.samples[totals.index(max(totals))]
    return max(totals), at.phase, at.unit


def _category_peaks(trace: Trace) -> dict[str, int]:
    keys = {k for s in trace.samples for k in s.bytes}
    return {k: max(s.bytes.get(k, 0) for s in trace.samples) for k in keys}


def _collectives(trace: Trace) -> list[tuple[str, str, str, str, int]]:
    return [(c.op, c.source, c.unit, c.phase, c.bytes) for c in trace.collectives]


@pytest.mark.parametrize(
    ("config", "shape", "names"),
    [
        (FSDP2Config(), (4,), ("dp_shard",)),
        (FSDP2Config(sequence_parallel=True, activation_checkpointing="full"), (2, 2), ("dp_shard", "tp")),
    ],
    ids=["fsdp", "fsdp-tp-sp-ac-full"],
)
def test_leaving_device_queries_untracked_records_the_step_the_plain_tracker_records(
    monkeypatch: pytest.MonkeyPatch, config: FSDP2Config, shape: tuple[int, ...], names: tuple[str, ...]
) -> None:
    fast = _step(config, shape, names)
    monkeypatch.setattr(_trace, "_DEVICE_QUERY", object())  # matches no operator: every call is tracked
    plain = _step(config, shape, names)

    assert len(fast.samples) < len(plain.samples), "the plain tracker samples every device query"
    assert _peak(fast) == _peak(plain)
    assert _category_peaks(fast) == _category_peaks(plain)
    assert fast.activations == plain.activations
    assert _collectives(fast) == _collectives(plain)
