"""``measure`` traces every block count of one shard count in one fake
world (DTensor's sharding decisions then carry over from trace to trace);
each trace equals a dry run of its own in a world of its own."""

from __future__ import annotations

import torch
from torch import nn

from fsdptx.cli._fit_measure import measure, trace_mesh
from fsdptx.cli._run import dry_run
from fsdptx.manager import FSDP2Config
from fsdptx.presets import build_preset


def _build(n: int | None) -> nn.Module:
    with torch.device("meta"):
        return build_preset("llama", n or 2, seq=64)


def test_traces_in_a_shared_world_equal_dry_runs_in_worlds_of_their_own() -> None:
    config = FSDP2Config(sequence_parallel=True)
    measured = measure(_build, (1, 2), 2, (2, 4), False, config, False, (1, 64), 1)
    for traced in measured.traces:
        for shards, trace in traced.points.items():
            alone = dry_run(_build(traced.layers), *trace_mesh(2, shards, False), config, batch_seq=(1, 64)).trace
            assert alone is not None
            assert trace.samples == alone.samples and trace.collectives == alone.collectives
            assert trace.activations == alone.activations
