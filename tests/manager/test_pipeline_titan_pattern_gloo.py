"""Pipeline parallelism against torchtitan's pattern by hand, on real
collectives: the ``Titan`` preset on pp=2 x dp=2 (four gloo ranks), trained
two SGD steps through ``FSDP2Manager(...).parallelize(model, loss_fn=...)``
and through torchtitan 0.2.2's ``pipeline_llm`` written out by hand
(``tests/support/titan_pipeline.py``), with 1F1B (two stages) and
Interleaved1F1B (four stages of one block each).

Both build the model from one seed, run the same stages under the same
torch schedule and add the same numbers in the same order, so the losses
agree exactly; and every rank issues the same collectives per step, op for
op and byte for byte: FSDP's all-gathers and reduce-scatters (one per
embedding, block and norm + head, as torchtitan shards them) and the
pipeline's sends and receives. Everything runs in one spawn.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdptx
from fsdptx.presets import Titan, TitanConfig
from fsdptx.testing import Collective, record_collectives, run_distributed
from titan_pipeline import pipeline_by_hand

BATCH, SEQ, MICROBATCHES, STEPS = 8, 8, 4, 2
CONFIG = TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=4, max_seq_len=16)
SCHEDULES = {"1F1B": 1, "Interleaved1F1B": 2}  # schedule -> stages per rank

def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _model() -> Titan:
    torch.manual_seed(0)
    return Titan(CONFIG)


def _nbytes(c: Collective) -> int:
    return max(torch.Size(s).numel() * d.itemsize for s, d in zip(c.shapes, c.dtypes))


def _train(mesh: Any, schedule: str, split: list[tuple[str, ...]] | None) -> dict[str, Any]:
    """fsdptx's pipeline when ``split`` is None, else the one by hand with
    ``split`` as its stages."""
    model = _model()
    if split is None:
        pipeline = fsdptx.PipelineParallelConfig(
            schedule=schedule, microbatches=MICROBATCHES, stages_per_rank=SCHEDULES[schedule]
        )
        stages = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(pipeline_parallel=pipeline, mp_policy=None), mesh).parallelize(
            model, loss_fn=loss_fn
        )
        assert isinstance(stages, fsdptx.PipelineStages)
        split = [tuple(s.modules) for s in stages.pipeline.stages]
        modules, is_first, is_last, run = list(stages), stages.is_first, stages.is_last, stages.step
    else:
        modules, torch_stages, sched = pipeline_by_hand(model, mesh, split, schedule, MICROBATCHES, loss_fn)
        is_first, is_last = any(s.is_first for s in torch_stages), any(s.is_last for s in torch_stages)

        def run(inputs: torch.Tensor | None, target: torch.Tensor | None) -> list[torch.Tensor] | None:
            losses: list[torch.Tensor] | None = [] if is_last else None
            sched.step(*(() if inputs is None else (inputs,)), target=target, losses=losses, return_outputs=False)
            return losses

    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=0.1)
    g = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    tokens = torch.randint(0, CONFIG.vocab, (BATCH, SEQ + 1), generator=g)
    losses, calls = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        with record_collectives() as step_calls:
            got = run(tokens[:, :-1] if is_first else None, tokens[:, 1:] if is_last else None)
        opt.step()
        losses.append([x.item() for x in got] if got is not None else None)
        calls.append(step_calls)
    last = calls[-1]
    return {
        "split": split,
        "losses": losses,
        "count": dict(Counter(c.op for c in last)),
        "bytes": dict(Counter({op: sum(_nbytes(c) for c in last if c.op == op) for op in {c.op for c in last}})),
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    del rank, world_size
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out: dict[str, Any] = {}
    for schedule in SCHEDULES:
        ours = _train(mesh, schedule, None)
        out[schedule] = {"fsdptx": ours, "by_hand": _train(mesh, schedule, ours["split"])}
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_worker, 4, timeout_s=300.0, collective_timeout_s=60.0)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_losses_equal_torchtitans_pipeline_by_hand(runs: list[dict[str, Any]], schedule: str) -> None:
    last_stage_ranks = [r for r in runs if r[schedule]["fsdptx"]["losses"][0] is not None]
    assert last_stage_ranks, "the last stage's ranks report the losses"
    for r in runs:
        assert r[schedule]["fsdptx"]["losses"] == r[schedule]["by_hand"]["losses"]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_rank_issues_torchtitans_collectives_per_step(runs: list[dict[str, Any]], schedule: str) -> None:
    """Count and bytes by op on every rank; an FSDP unit spanning a whole
    one-block stage would show as fewer all-gathers than torchtitan's."""
    blocks_per_stage = CONFIG.layers // (2 * SCHEDULES[schedule])
    for rank, r in enumerate(runs):
        ours, theirs = r[schedule]["fsdptx"], r[schedule]["by_hand"]
        assert ours["count"] == theirs["count"], (rank, ours["count"], theirs["count"])
        assert ours["bytes"] == theirs["bytes"], (rank, ours["bytes"], theirs["bytes"])
        gathers = sum(n for op, n in ours["count"].items() if "allgather" in op or "all_gather" in op)
        assert gathers >= blocks_per_stage * SCHEDULES[schedule], (rank, ours["count"])
