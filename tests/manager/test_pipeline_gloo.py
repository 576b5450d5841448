"""Pipeline parallelism on real collectives: four gloo ranks train pipelined
models five SGD steps in fp32 and match one process training the whole
model on the whole batch; a checkpoint saved on the pipeline loads without it.

Layouts, all through ``FSDP2Manager(...).parallelize(model, loss_fn=...)``:

- the ``Decoder`` preset (4 blocks) on pp=2 x dp=2 with 1F1B, and with
  Interleaved1F1B (2 stages per rank, 4 stages of one block);
- the same on pp=2 x tp=2 with sequence parallelism;
- a Hugging Face Llama (untied embeddings, sdpa attention) on pp=2 x dp=2;
- the torchtitan-style ``Titan`` preset (blocks in an ``nn.ModuleDict``,
  rotary tables on the root) on pp=2 x dp=2.

Why parity is exact up to summation order: the schedule divides each
micro-batch's gradient by the number of micro-batches, so a stage's
gradient is that of the mean loss over its rank's batch; FSDP averages over
the dp ranks, whose batches are equal halves of one global batch; tensor
parallelism and sequence parallelism compute the same sums in pieces. The
learning rate is large, so a wrong gradient scale (a sum instead of a mean,
a missing stage) moves the weights far beyond the tolerance.

A DCP checkpoint (``get_model_state_dict`` of every stage module, one
``dcp.save``) written after the 1F1B run loads on dp=4 (FSDP without
pipeline) and into a plain model in one process, keyed by the whole
model's FQNs. Everything runs in one spawn of four processes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig, Titan, TitanConfig
from fsdptx.testing import run_distributed

WORLD = 4
STEPS = 5
LR = 0.5
BATCH, SEQ, MICROBATCHES = 8, 8, 4
REL = 1e-5
DECODER = DecoderConfig(vocab=64, dim=32, hidden=64, layers=4)
TITAN = TitanConfig(vocab=64, dim=32, n_heads=4, n_kv_heads=2, hidden=64, layers=4, max_seq_len=16)


def decoder(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Decoder(DECODER)


def titan(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Titan(TITAN)


def llama(seed: int = 0) -> nn.Module:
    import hf_zoo
    from fsdptx.hf import build_hf_model

    torch.manual_seed(seed)
    overrides = {**hf_zoo._DENSE, "tie_word_embeddings": False, "attn_implementation": "sdpa"}
    model = build_hf_model("llama", overrides, dtype=torch.float32, device="cpu")
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    return model


MODELS: dict[str, tuple[Callable[..., nn.Module], int]] = {
    "decoder": (decoder, DECODER.vocab),
    "titan": (titan, TITAN.vocab),
    "llama": (llama, 128),
}

# name -> (model, mesh shape, mesh dims, PipelineParallelConfig options, sequence_parallel)
LAYOUTS: dict[str, tuple[str, tuple[int, ...], tuple[str, ...], dict[str, Any], bool]] = {
    "decoder pp2 x dp2 1F1B": ("decoder", (2, 2), ("pp", "dp"), {"schedule": "1F1B"}, False),
    "decoder pp2 x dp2 Interleaved1F1B": (
        "decoder", (2, 2), ("pp", "dp"), {"schedule": "Interleaved1F1B", "stages_per_rank": 2}, False,
    ),
    "decoder pp2 x tp2 SP": ("decoder", (2, 2), ("pp", "tp"), {"schedule": "1F1B"}, True),
    "llama pp2 x dp2 1F1B": ("llama", (2, 2), ("pp", "dp"), {"schedule": "1F1B"}, False),
    "titan pp2 x dp2 1F1B": ("titan", (2, 2), ("pp", "dp"), {"schedule": "1F1B"}, False),
}
CHECKPOINTED = "decoder pp2 x dp2 1F1B"


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference(model_name: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole batch: losses, initial and final parameters."""
    build, vocab = MODELS[model_name]
    model = build()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = batch(vocab)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model(x) if model_name != "llama" else model(input_ids=x).logits, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, initial, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(layout: str) -> tuple[dict[str, Any], fsdptx.PipelineStages]:
    model_name, shape, names, options, sp = LAYOUTS[layout]
    build, vocab = MODELS[model_name]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    config = fsdptx.FSDP2Config(
        mp_policy=None,
        sequence_parallel=sp,
        pipeline_parallel=fsdptx.PipelineParallelConfig(microbatches=MICROBATCHES, **options),
    )
    stages = fsdptx.FSDP2Manager(config, mesh).parallelize(build(), loss_fn=loss_fn)
    assert isinstance(stages, fsdptx.PipelineStages)
    opt = torch.optim.SGD([p for m in stages for p in m.parameters()], lr=LR)
    x, y = batch(vocab)
    if "dp" in names:
        dp = mesh["dp"]
        x, y = x.chunk(dp.size())[dp.get_local_rank()], y.chunk(dp.size())[dp.get_local_rank()]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        got = stages.step(inputs=x if stages.is_first else None, target=y if stages.is_last else None)
        if "tp" in names:
            fsdptx.synchronize_tp_replica_gradients(stages, mesh)
        opt.step()
        if got is not None:
            losses.append(torch.stack(got).mean())
    out: dict[str, Any] = {"indices": stages.indices, "losses": None}
    if losses:
        mean = torch.stack(losses).detach()
        if "dp" in names:  # every member of a last-stage rank's dp group is a last-stage rank
            dist.all_reduce(mean, group=mesh["dp"].get_group())
            mean /= mesh["dp"].size()
        out["losses"] = mean.tolist()
    out["params"] = {n: full(p) for m in stages for n, p in m.named_parameters()}
    if "tp" in names:
        out["audit"] = _audit_with_one_drift(stages, mesh)
    return out, stages


def _audit_with_one_drift(stages: fsdptx.PipelineStages, mesh: DeviceMesh) -> dict[str, Any]:
    """``audit_replicas`` on the stages after training (replicas in sync),
    then with one TP-replicated norm weight nudged on TP rank 1 of each
    stage (found, by its whole-model FQN)."""
    clean = fsdptx.audit_replicas(stages, mesh)
    nudged = []
    for module in stages:
        name, p = next((n, p) for n, p in module.named_parameters() if "norm" in n and isinstance(p, DTensor))
        if mesh["tp"].get_local_rank() == 1:
            with torch.no_grad():
                p.to_local().add_(1.0)
        nudged.append(name)
    drifted = fsdptx.audit_replicas(stages, mesh)
    return {"clean": clean.ok, "drifted": drifted.ok, "found": sorted(d.fqn for d in drifted.drifted), "nudged": nudged}


def _save(stages: fsdptx.PipelineStages, directory: str) -> list[str]:
    state: dict[str, Any] = {}
    for module in stages:
        state.update(get_model_state_dict(module))
    dcp.save({"model": state}, checkpoint_id=directory)
    return sorted(state)


def _load_on_dp4(directory: str) -> dict[str, torch.Tensor]:
    mesh: DeviceMesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    model = decoder(seed=123)  # other values: the load must overwrite every one
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh).parallelize(model)
    state = get_model_state_dict(model)
    dcp.load({"model": state}, checkpoint_id=directory)
    set_model_state_dict(model, state)
    return {n: full(p) for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    del rank, world_size
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        out[layout], stages = _train(layout)
        if layout == CHECKPOINTED:
            out["saved_keys"] = _save(stages, directory)
    out["loaded_dp4"] = _load_on_dp4(directory)
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline_dcp")


@pytest.fixture(scope="module")
def runs(checkpoint_dir: Path) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, str(checkpoint_dir), timeout_s=600, collective_timeout_s=120)


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = expected.abs().max().item()
    worst = (actual - expected).abs().max().item()
    assert worst <= REL * scale, f"{what}: max |difference| {worst:.3g} exceeds {REL} x max |value| {scale:.3g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelined_training_matches_one_process(runs: list[dict[str, Any]], layout: str) -> None:
    want_losses, initial, want = reference(LAYOUTS[layout][0])
    per_rank = [r[layout] for r in runs]
    last = [r for r in per_rank if r["losses"] is not None]
    assert last, "no rank ran the last stage"
    for r in last:
        _assert_rel(torch.tensor(r["losses"]), torch.tensor(want_losses), f"{layout}: losses")
    held = {n for r in per_rank for n in r["params"]}
    assert held == want.keys(), f"{layout}: the stages hold {sorted(held ^ want.keys())} unlike the whole model"
    for rank, r in enumerate(per_rank):
        for name, value in r["params"].items():
            _assert_rel(value, want[name], f"{layout}: rank {rank} {name}")
    # the steps move the weights far beyond the tolerance: the comparison has teeth
    moved = [n for n in want if (want[n] - initial[n]).abs().max() > 100 * REL * want[n].abs().max()]
    assert len(moved) >= len(want) // 2, f"{layout}: only {moved} moved"


def test_replica_audit_of_tp_stages_is_clean_after_training_and_names_a_drifted_norm(runs: list[dict[str, Any]]) -> None:
    audits = [r["decoder pp2 x tp2 SP"]["audit"] for r in runs]
    for rank, a in enumerate(audits):
        assert a["clean"], f"rank {rank}: replicas drifted in training"
        assert not a["drifted"], f"rank {rank}: the nudged norm went unseen"
        assert set(a["nudged"]) <= set(a["found"]), (rank, a)
    # each pp rank's audit sees its own stage's norm; every rank gets the same answer
    assert len({tuple(a["found"]) for a in audits}) == 1, audits


def test_interleaved_ranks_run_two_stages_each_in_loop_order(runs: list[dict[str, Any]]) -> None:
    indices = [r["decoder pp2 x dp2 Interleaved1F1B"]["indices"] for r in runs]
    assert indices == [(0, 2), (0, 2), (1, 3), (1, 3)]


def test_pipeline_checkpoint_keys_are_the_whole_models_fqns(runs: list[dict[str, Any]]) -> None:
    plain = set(decoder().state_dict())
    saved = [set(r["saved_keys"]) for r in runs]
    assert set().union(*saved) == plain
    assert saved[0].isdisjoint(saved[2]), "each pipeline rank saves its own stage's keys"


def test_a_checkpoint_saved_on_pp2_dp2_loads_on_dp4_with_equal_values(runs: list[dict[str, Any]]) -> None:
    saved = {n: v for r in runs for n, v in r[CHECKPOINTED]["params"].items()}
    for rank, r in enumerate(runs):
        assert r["loaded_dp4"].keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(r["loaded_dp4"][name], value), f"rank {rank} {name}"


# torch warns that it assumes a single-process load even when no_dist=True says so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_a_checkpoint_saved_on_pp2_dp2_loads_into_a_plain_model_in_one_process(
    runs: list[dict[str, Any]], checkpoint_dir: Path
) -> None:
    model = decoder(seed=123)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    model.load_state_dict(state["model"])
    saved = {n: v for r in runs for n, v in r[CHECKPOINTED]["params"].items()}
    assert sorted(dict(model.named_parameters())) == sorted(saved)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name
