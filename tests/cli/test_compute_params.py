"""``--fit``'s compute counts what one token multiplies: every parameter of a
dense model but its embedding table, and of an MoE layer's routed experts
``top_k / num_experts`` (shared experts and routers in full)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable
from typing import Any

import pytest
from torch import nn

from fsdptx.cli._compute_params import compute_params
from fsdptx.cli._main import main

import hf_zoo
import moe_ep_model

MOE: dict[str, Callable[[], nn.Module]] = {
    "deepseek_v3": hf_zoo.deepseek_v3,
    "mixtral": hf_zoo.mixtral,
    "qwen3_moe": hf_zoo.qwen3_moe,
    "qwen2_moe": hf_zoo.qwen2_moe,
    "olmoe": hf_zoo.olmoe,
    "gpt_oss": hf_zoo.gpt_oss,
}


def _multiplying(model: nn.Module) -> int:
    """Every distinct parameter outside embedding tables, plus a table a head is tied to."""
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    heads = {id(p) for m in model.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedded or id(p) in heads)


def _experts(model: nn.Module) -> list[nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


@pytest.mark.parametrize("name", list(MOE))
def test_routed_experts_count_top_k_of_num_experts_and_the_rest_in_full(name: str) -> None:
    model = MOE[name]()
    top_k = model.config.num_experts_per_tok
    experts = _experts(model)
    assert experts, name
    routed = [sum(p.numel() for p in m.parameters()) for m in experts]
    n = experts[0].num_experts
    got = compute_params(model)
    assert got.total == _multiplying(model)
    assert got.active == got.total - sum(routed) + sum(r * top_k // n for r in routed)
    assert got.active < got.total
    assert f"top_k / num_experts = {top_k}/{n}" in got.note


def test_a_dense_model_counts_every_parameter_but_its_embedding_table() -> None:
    model = hf_zoo.llama()
    got = compute_params(model)
    assert got.total == got.active == _multiplying(model)
    assert got.total < sum(p.numel() for p in model.parameters())
    assert got.note == ""


def test_a_head_tied_to_the_embedding_multiplies_and_counts() -> None:
    model = hf_zoo.qwen3_tied()
    assert compute_params(model).total == _multiplying(model) == sum(p.numel() for p in model.parameters())


def test_declared_experts_without_a_known_top_k_all_count_and_say_so() -> None:
    """A model's own experts module (``_fsdptx_expert_modules``) with neither
    a ``num_experts`` attribute nor a config naming ``top_k``."""
    model = moe_ep_model.build()
    got = compute_params(model)
    assert got.active == got.total == _multiplying(model)
    assert got.note == "every routed expert of layers.*.experts counts (top_k or the expert count unknown): compute is an upper bound"


def _fit(*argv: str) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["plan", *argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(out.getvalue())
    return data["fit"]


def test_fit_predicts_an_moe_models_compute_from_the_parameters_a_token_runs() -> None:
    """The compute of every candidate is the 6N rule over the active
    parameters: halving N (top-2 of 4 experts against all 4) is what
    separates it from counting every expert."""
    config = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
    config += "vocab_size=128,num_local_experts=4,num_experts_per_tok=2"
    fit = _fit("--hf", "mixtral", "--hf-config", config, "--seq", "64", "--fit", "4x1GiB", "--fit-jobs", "1")
    params = fit["compute_params"]
    assert params["active"] < params["total"] and "2/4" in params["note"]
    hw = fit["hardware"]
    for c in fit["fitting"] + fit["not_fitting"]:
        tp_cp = c["mesh"].get("tp", 1) * c["mesh"].get("cp", 1)
        recompute = {None: 0.0, "selective": 0.2, "full": 2.0}[c["activation_checkpointing"]]
        flops = (6 + recompute) * params["active"] * fit["batch"] * fit["seq"] / tp_cp
        assert c["predicted_step"]["compute_ms"] == pytest.approx(1e3 * flops / (hw["flops_per_s"] * hw["mfu"]), rel=1e-9)
