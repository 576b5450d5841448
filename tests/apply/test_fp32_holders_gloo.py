"""fp32 parameters kept fp32 on purpose inside a bf16 model compute in fp32.

A training script keeps GPT-OSS ``sinks``, Qwen3-Next / Qwen3.5 ``A_log``
and ``dt_bias``, Mamba2 / NemotronH ``A_log``, ``D``, ``dt_bias`` in fp32
while the bulk of the model is bf16. Such a parameter is no fp32 master
weight: the planner resolves it as fp32 compute (the bulk decided by
trainable numel) and says so in the Plan. An fp32-bulk model keeps its
master weights computing in bf16.

Also here: a holder whose forward returns its own parameter (attention
sinks that ignore their input) keeps its unit gathered after forward, so a
layout where each block's holder is a unit of its own trains.

One gloo spawn (2 ranks, dp=2) trains every model; each is compared with
the same model, plan and policy in one process (a one-rank fake world), not
with fp32: bf16 compute is what is being tested.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.hf import build_hf_model  # noqa: E402
from fsdptx.presets import Decoder, DecoderConfig  # noqa: E402
from fsdptx.testing import fake_mesh, run_distributed  # noqa: E402

import hf_zoo  # noqa: E402

WORLD = 2
STEPS = 2
BATCH = 2  # per rank
SEQ = 8
LR = 0.1
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
PIPELINE = fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks)
# Blocks only: each block's fp32 holder becomes a unit of its own.
PER_BLOCK = fsdptx.shard_by_dtype
# bf16 has an 8-bit significand: one rounding differs by up to 2**-8
# relative. The dp=2 run rounds each half batch's bf16 gradients and
# averages them in fp32; the one-process run rounds the whole batch's once.
# Over two SGD steps that is a few roundings of each parameter: 2**-6
# relative, and the same absolute margin for values near zero. fp32
# holders get the same margin: they are fp32 themselves, but their
# gradients are computed from bf16 activations.
BF16_TOL = 2**-6


def qwen3_5(device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Qwen3.5 (text): layer 0 gated delta-net with ``A_log``/``dt_bias``
    directly on ``model.layers.0.linear_attn``, layer 1 full attention."""
    overrides = {
        **hf_zoo._DENSE,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    }
    return build_hf_model("qwen3_5_text", overrides, dtype=dtype, device=device, keep_in_fp32=("A_log", "dt_bias"))


BUILDERS = {
    "gpt_oss": hf_zoo.gpt_oss,
    "qwen3_next": hf_zoo.qwen3_next,
    "qwen3_5": qwen3_5,
    "mamba2": hf_zoo.mamba2,
    "nemotron_h": hf_zoo.nemotron_h,
}
HOLDERS = {
    "gpt_oss": ("sinks",),
    "qwen3_next": ("A_log", "dt_bias"),
    "qwen3_5": ("A_log", "dt_bias"),
    "mamba2": ("A_log", "D", "dt_bias"),
    "nemotron_h": ("A_log", "D", "dt_bias"),
}


def build(name: str, device: str = "cpu") -> nn.Module:
    """The bf16 model with its holders fp32 as a training script leaves
    them: stored fp32, with no compute-dtype hint (the planner must tell
    from the bulk alone)."""
    torch.manual_seed(0)
    model = BUILDERS[name](device, torch.bfloat16)
    for p in model.parameters():
        p.__dict__.pop("_hf_compute_dtype", None)
    return model


def holder_names(name: str, model: nn.Module) -> list[str]:
    return [n for n, _p in model.named_parameters() if n.rpartition(".")[2] in HOLDERS[name]]


def small_decoder() -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab=64, dim=16, hidden=32, layers=2, fp32_holders=True))


def tokens_for(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (STEPS, BATCH * WORLD, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens[:, :-1])  # input_ids for the HF models, tokens for the preset decoder
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train(model: nn.Module, transform: Any, mesh: Any, rank: int, world: int, vocab: int) -> dict[str, Any]:
    plan = fsdptx.plan(model, transform, mp_policy=POLICY)
    fsdptx.apply_plan(plan, model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = BATCH * WORLD // world
    losses = []
    for tokens in tokens_for(vocab):
        opt.zero_grad()
        loss = loss_of(model, tokens[rank * per_rank : (rank + 1) * per_rank])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "compute": compute_dtypes(model)}


def compute_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """Parameter FQN -> the dtype FSDP computes it in (its unit's
    ``param_dtype``, or its own dtype when the unit casts nothing)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.dtype] = {}
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            if id(fp.sharded_param) in names:
                out[names[id(fp.sharded_param)]] = group.mp_policy.param_dtype or fp.orig_dtype
    return out


def jobs() -> list[tuple[str, Any, Any, int]]:
    """(name, builder, transform, vocab) of every run."""
    out: list[tuple[str, Any, Any, int]] = [(n, functools.partial(build, n), PIPELINE, hf_zoo.VOCAB) for n in BUILDERS]
    out.append(("sinks_per_block", small_decoder, PER_BLOCK, 64))
    return out


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    return {name: train(make(), transform, mesh, rank, world_size, vocab) for name, make, transform, vocab in jobs()}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_worker, WORLD, timeout_s=600, collective_timeout_s=120)


@functools.cache
def reference(name: str) -> dict[str, Any]:
    """The same model, plan and policy in one process (a one-rank world)."""
    (make, transform, vocab) = next((m, t, v) for n, m, t, v in jobs() if n == name)
    with fake_mesh((1,), ("dp",)) as mesh:
        return train(make(), transform, mesh, 0, 1, vocab)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fp32_holders_in_a_bf16_model_plan_as_fp32_compute(name: str) -> None:
    model = build(name, "meta")
    plan = fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    holders = holder_names(name, model)
    assert holders and all(model.get_parameter(h).dtype == torch.float32 for h in holders)
    owner = plan.owned_params
    for h in holders:
        unit = plan.units[owner[h]]
        assert unit.compute_dtype == torch.float32, (h, unit)
        assert unit.mp_policy is not None and unit.mp_policy.param_dtype == torch.float32
        assert "fp32: intrinsic, bfloat16 bulk" in unit.reasons
    assert "fp32: intrinsic, bfloat16 bulk" in str(plan)
    bulk = [u for u in plan.units if u.storage_dtype == torch.bfloat16]
    assert bulk and all(u.compute_dtype == torch.bfloat16 for u in bulk)


def test_fp32_master_weights_still_compute_in_bf16() -> None:
    model = hf_zoo.llama("meta", torch.float32)
    plan = fsdptx.plan(model, PIPELINE, mp_policy=POLICY)
    assert plan.units and all(u.compute_dtype == torch.bfloat16 and not u.reasons for u in plan.units)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fp32_holders_train_on_dp2_in_parity_with_one_process(runs: list[dict[str, dict[str, Any]]], name: str) -> None:
    ref = reference(name)
    holders = set(holder_names(name, build(name, "meta")))
    for result in (r[name] for r in runs):
        assert {h: result["compute"][h] for h in holders} == dict.fromkeys(holders, torch.float32)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=BF16_TOL, atol=0)
        for n, value in ref["params"].items():
            torch.testing.assert_close(result["params"][n], value, rtol=BF16_TOL, atol=BF16_TOL, msg=n)


def test_holder_returning_its_parameter_is_kept_gathered_in_the_plan() -> None:
    plan = fsdptx.plan(small_decoder(), PER_BLOCK, mp_policy=POLICY)
    sinks = [u for u in plan.units if u.modules[0].endswith(".sinks")]
    assert len(sinks) == 2
    assert all(u.reshard_after_forward is False for u in sinks)
    assert all("gathered: holder may return its parameter" in u.reasons for u in sinks)
    assert "gathered: holder may return its parameter" in str(plan)


def test_per_block_holder_units_train_on_dp2_in_parity_with_one_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    ref = reference("sinks_per_block")
    for result in (r["sinks_per_block"] for r in runs):
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=BF16_TOL, atol=0)
        for n, value in ref["params"].items():
            torch.testing.assert_close(result["params"][n], value, rtol=BF16_TOL, atol=BF16_TOL, msg=n)
