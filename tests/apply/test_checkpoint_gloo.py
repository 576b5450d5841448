"""Distributed checkpoints (torch DCP) of an fsdptx-parallelized model move
between meshes and resume training exactly.

Saved on dp=2 x tp=2 with sequence parallelism, full activation
checkpointing and cross-block units (the ``Decoder`` preset's per-block
``sinks`` holders), with AdamW; loaded on a model re-planned for dp=4 and
into a plain model in one process. The recipe is ``docs/checkpointing.md``:
``get_state_dict`` / ``dcp.save`` / ``dcp.load`` / ``set_state_dict``.

Resume parity: 3 steps, save, load on dp=4, 2 more steps equals 5 steps
without interruption (the uninterrupted run is the saving run carried on).
Why exact up to summation order: each dp rank's loss is the mean over its
equal share of one global batch and FSDP averages over dp ranks, so dp=2 x
tp=2 and dp=4 compute the same global-mean gradient.

All distributed steps run in one spawn of 4 processes; the checkpoint
directory is a pytest tmp dir handed to the workers as an argument.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import run_distributed

WORLD = 4
CFG = DecoderConfig(vocab=64, dim=32, hidden=64, layers=2, fp32_holders=True)
SAVED_ON = fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None, activation_checkpointing="full")
LOADED_ON = fsdptx.FSDP2Config(mp_policy=None, activation_checkpointing="full")
GLOBAL_BATCH = 4
SEQ = 8
STEPS_BEFORE, STEPS_AFTER = 3, 2


def make_model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(CFG)
    with torch.no_grad():
        for block in model.layers:
            block.sinks.weight.normal_(0, 0.1)
    return model


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab, (STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH, SEQ + 1), generator=g)


def step(model: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh, tokens: torch.Tensor) -> float:
    """One AdamW step on this dp rank's share of ``tokens``; the global mean loss."""
    names = mesh.mesh_dim_names or ()
    dp_size = mesh["dp"].size()
    dp_rank = mesh["dp"].get_local_rank()
    share = GLOBAL_BATCH // dp_size
    local = tokens[dp_rank * share : (dp_rank + 1) * share]
    opt.zero_grad()
    logits = model(local[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, CFG.vocab), local[:, 1:].reshape(-1))
    loss.backward()
    if "tp" in names:
        fsdptx.synchronize_tp_replica_gradients([model], mesh)
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    return total.item() / dp_size


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }


def parallelized(config: fsdptx.FSDP2Config, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    fsdptx.FSDP2Manager(config, mesh).parallelize(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    data = batches()

    # dp=2 x tp=2 + SP + full AC + cross-block units: 3 steps, save, 2 more.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = parallelized(SAVED_ON, mesh)
    losses = [step(model, opt, mesh, data[i]) for i in range(STEPS_BEFORE)]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    out["saved"] = full_params(model)
    out["saved_keys"] = sorted(model_sd)
    losses += [step(model, opt, mesh, data[i]) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)]
    out["uninterrupted"] = {"losses": losses, "params": full_params(model)}

    # Re-planned for dp=4: load, compare, train 2 more steps.
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model4, opt4 = parallelized(LOADED_ON, mesh4)
    model_sd, optim_sd = get_state_dict(model4, opt4)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(model4, opt4, model_state_dict=model_sd, optim_state_dict=optim_sd)
    out["loaded_dp4"] = full_params(model4)
    resumed = losses[:STEPS_BEFORE] + [
        step(model4, opt4, mesh4, data[i]) for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    ]
    out["resumed"] = {"losses": resumed, "params": full_params(model4)}
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


@pytest.fixture(scope="module")
def runs(checkpoint_dir: Path) -> list[dict[str, Any]]:
    return run_distributed(_worker, WORLD, str(checkpoint_dir), timeout_s=400, collective_timeout_s=120)


def test_checkpoint_keys_are_the_plain_models_parameter_names(runs: list[dict[str, Any]]) -> None:
    plain = sorted(make_model().state_dict())
    for rank, r in enumerate(runs):
        assert r["saved_keys"] == plain, f"rank {rank}"


def test_a_checkpoint_saved_on_dp2_tp2_sp_loads_on_dp4_with_equal_values(runs: list[dict[str, Any]]) -> None:
    saved = runs[0]["saved"]
    for rank, r in enumerate(runs):
        assert r["loaded_dp4"].keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(r["loaded_dp4"][name], value), f"rank {rank} {name}"


# torch warns that it assumes a single-process load even when no_dist=True says so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_a_checkpoint_saved_on_dp2_tp2_sp_loads_into_a_plain_model_in_one_process(
    runs: list[dict[str, Any]], checkpoint_dir: Path
) -> None:
    model = make_model(seed=123)  # other values, so the load must overwrite every one
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)  # one process, no process group
    model.load_state_dict(state["model"])
    saved = runs[0]["saved"]
    assert sorted(dict(model.named_parameters())) == sorted(saved)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_resuming_on_another_mesh_matches_uninterrupted_training(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        reference, resumed = r["uninterrupted"], r["resumed"]
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-5,
            msg=f"rank {rank} losses",
        )
        for name, value in reference["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {name}")
    # the last two steps changed the parameters: the comparison has teeth
    assert any(not torch.equal(runs[0]["saved"][n], v) for n, v in runs[0]["uninterrupted"]["params"].items())
