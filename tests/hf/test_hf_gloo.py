"""Real Hugging Face models, sharded by fsdptx's defaults, train like one
process on 2 gloo ranks.

- Qwen3 (tied embeddings) with Hugging Face's own TP plan on tp=2, with and
  without sequence parallelism: q/k/v/
  gate/up colwise, o/down rowwise, vocabulary-sharded embedding tied to the
  gathered LM head, and ``q_norm``/``k_norm`` declared
  ``replicated_with_grad_allreduce``. Those norms normalize only the rank's
  local heads, so each rank's gradient is its heads' share and the full
  gradient is the *sum* over TP ranks; fsdptx derives a ``sum`` mark from
  the declaration and ``synchronize_tp_replica_gradients`` applies it. A
  control run with ``mean`` marks instead must miss the reference.
- GPT-OSS with fp32 attention sinks sitting directly on ``self_attn``
  beside bf16-able projections, on dp=2 with the default pipeline.

Everything is fp32 with mixed precision disabled, so only summation order
differs from the single-process reference (tolerance 1e-5).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
import fsdptx.hf  # noqa: E402
from fsdptx.testing import run_distributed  # noqa: E402

import hf_zoo  # noqa: E402

WORLD = 2
STEPS = 3
BATCH = 2
SEQ = 8
LR = 0.5
TOL = 1e-5


BUILDERS = {**hf_zoo.ZOO, "olmo2": hf_zoo.olmo2}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = BUILDERS[name]("cpu", torch.float32)
    return model


def batches(vocab: int, batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (STEPS, batch, SEQ + 1), generator=g)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()
    }


@functools.cache
def reference(name: str, batch: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(model.config.vocab_size, batch):
        opt.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, full_params(model)


def _train_tp(
    mesh: Any, reduction: str | None, sequence_parallel: bool = False, name: str = "qwen3_tied"
) -> dict[str, Any]:
    """A model (Qwen3 by default) on tp=2 with its declared TP plan;
    ``reduction`` replaces Qwen3's norms' declared reduction (the
    control): their ``replicated_with_grad_allreduce`` entries are dropped
    from the TP plan and the model marks them itself."""
    model = build(name)
    tp_plan = None
    if reduction is not None:
        norms = ("model.layers.*.self_attn.q_norm", "model.layers.*.self_attn.k_norm")
        tp_plan = {g: s for g, s in fsdptx.hf.hf_tp_plan(model).items() if g not in norms}
        model._tp_replica_reductions = dict.fromkeys(norms, reduction)
    config = fsdptx.FSDP2Config(mp_policy=None, tp_plan=tp_plan, sequence_parallel=sequence_parallel)
    manager = fsdptx.FSDP2Manager(config, mesh)
    plan = manager.plan(model)
    manager.parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(model.config.vocab_size, BATCH):  # every TP rank reads the same samples
        opt.zero_grad()
        loss = loss_of(model, tokens)
        loss.backward()
        fsdptx.synchronize_tp_replica_gradients([model], mesh)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model), "reductions": dict(plan.reductions)}


def _train_dp(mesh: Any, rank: int) -> dict[str, Any]:
    """GPT-OSS on dp=2 with the default pipeline (fp32 sinks included)."""
    model = build("gpt_oss")
    fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh).parallelize(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in batches(model.config.vocab_size, BATCH * WORLD):
        opt.zero_grad()
        loss = loss_of(model, tokens[rank * BATCH : (rank + 1) * BATCH])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / WORLD)
    return {"losses": losses, "params": full_params(model)}


def _worker(rank: int, world_size: int, jobs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    out: dict[str, dict[str, Any]] = {}
    if any(j.startswith("qwen3") for j in jobs):
        tp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        out["qwen3"] = _train_tp(tp, None)
        out["qwen3_mean"] = _train_tp(tp, "mean")
        out["qwen3_sp"] = _train_tp(tp, None, sequence_parallel=True)
        out["olmo2_sp"] = _train_tp(tp, None, sequence_parallel=True, name="olmo2")
    if "gpt_oss" in jobs:
        dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        out["gpt_oss"] = _train_dp(dp, rank)
    return out


JOBS: tuple[str, ...] = ("qwen3", "gpt_oss")


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(_worker, WORLD, JOBS, timeout_s=300, collective_timeout_s=60)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in b)


def assert_parity(
    result: dict[str, Any], ref: tuple[list[float], dict[str, torch.Tensor]], tol: float = TOL
) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref[0]), rtol=tol, atol=0)
    for name, value in ref[1].items():
        torch.testing.assert_close(result["params"][name], value, rtol=0, atol=tol, msg=name)


def test_qwen3_tp_plan_derives_sum_marks_for_q_and_k_norms(runs: list[dict[str, dict[str, Any]]]) -> None:
    marks = runs[0]["qwen3"]["reductions"]
    norms = {n for n in marks if n.endswith(("q_norm.weight", "k_norm.weight"))}
    assert norms and all(marks[n] == "sum" for n in norms), marks


def test_qwen3_with_hf_tp_plan_on_tp2_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    ref = reference("qwen3_tied", BATCH)
    for result in runs:
        assert_parity(result["qwen3"], ref)


def test_qwen3_with_sequence_parallelism_on_tp2_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    """The sequence is split where the first block receives it (the
    embedding returns it whole: rotary positions come from its length),
    norms run on the local half, attention and MLP gather it back."""
    ref = reference("qwen3_tied", BATCH)
    for result in runs:
        assert_parity(result["qwen3_sp"], ref)


def test_qwen3_with_mean_marks_on_q_and_k_norms_misses_the_reference(runs: list[dict[str, dict[str, Any]]]) -> None:
    """The control: averaging the heads' shares scales the norms' gradient
    by 1/2, which the comparison must notice."""
    ref = reference("qwen3_tied", BATCH)
    assert _max_diff(runs[0]["qwen3_mean"]["params"], ref[1]) > 100 * TOL


def test_gpt_oss_with_fp32_sinks_on_dp2_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    ref = reference("gpt_oss", BATCH * WORLD)
    for result in runs:
        assert_parity(result["gpt_oss"], ref)
    sinks = [n for n in ref[1] if n.endswith("sinks")]
    assert sinks and all(runs[0]["gpt_oss"]["params"][n].dtype == torch.float32 for n in sinks)




def test_olmo2_with_sequence_parallelism_on_tp2_matches_single_process(runs: list[dict[str, dict[str, Any]]]) -> None:
    """Olmo2's q/k/v gather their outputs (``colwise_gather_output``): under
    SP the attention module gathers the sequence once and the projections
    take it replicated, as in the plain layout; they used to each gather it
    themselves while attention reshaped by the local length. Tolerance
    2e-5: its embedding ends 1.2e-5 from the reference in the plain TP
    layout too (summation order, at LR 0.5)."""
    ref = reference("olmo2", BATCH)
    for result in runs:
        assert_parity(result["olmo2_sp"], ref, tol=2e-5)
