"""Real ``transformers`` models built tiny from their config classes: storage
dtypes as loading gives them, the declarations they carry, CPU forwards."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import hf_zoo  # noqa: E402

from fsdptx.hf import (  # noqa: E402
    build_hf_model,
    hf_expert_modules,
    hf_fp32_compute_tokens,
    hf_replica_reductions,
    hf_tied_weights,
    hf_tp_plan,
)

# Parameters each zoo model stores in fp32 when the bulk is bf16.
FP32_HOLDERS: dict[str, set[str]] = {
    "llama": set(),
    "qwen3_tied": set(),
    "qwen3_moe": set(),
    "gpt_oss": {f"model.layers.{i}.self_attn.sinks" for i in range(2)},
    "qwen3_next": {"model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias"},
    "mamba2": {f"backbone.layers.{i}.mixer.{n}" for i in range(2) for n in ("A_log", "D", "dt_bias")},
    "nemotron_h": {
        "model.layers.0.mixer.A_log",
        "model.layers.0.mixer.D",
        "model.layers.0.mixer.dt_bias",
        "model.layers.2.mixer.gate.weight",
    },
    "gemma3_multimodal": set(),
    "kimi_linear": {"model.layers.0.self_attn.forget_gate.dt_bias", "model.layers.1.mlp.gate.weight"},
}


@functools.cache
def meta_model(name: str) -> nn.Module:
    """One meta build per model for the read-only tests (building is the slow part)."""
    return hf_zoo.ZOO[name]("meta")


def fp32_params(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.dtype == torch.float32}


@pytest.mark.parametrize("name", sorted(hf_zoo.ZOO))
def test_zoo_model_on_meta_stores_fp32_holders_fp32_and_the_rest_bf16(name: str) -> None:
    model = meta_model(name)
    others = {p.dtype for n, p in model.named_parameters() if n not in FP32_HOLDERS[name]}
    assert (fp32_params(model), others) == (FP32_HOLDERS[name], {torch.bfloat16})


@pytest.mark.parametrize("name", sorted(hf_zoo.ZOO))
def test_zoo_model_builds_every_parameter_on_meta(name: str) -> None:
    assert {p.device.type for p in meta_model(name).parameters()} == {"meta"}


@pytest.mark.parametrize("name", sorted(hf_zoo.ZOO))
def test_zoo_model_forwards_on_cpu_in_fp32(name: str) -> None:
    model = hf_zoo.ZOO[name]("cpu", torch.float32).eval()
    ids = torch.randint(3, hf_zoo.VOCAB - 1, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 8, hf_zoo.VOCAB) and bool(torch.isfinite(logits).all())


def test_fp32_master_weights_build_all_fp32_without_compute_hints() -> None:
    model = hf_zoo.llama("meta", torch.float32)
    hinted = [n for n, p in model.named_parameters() if hasattr(p, "_hf_compute_dtype")]
    assert ({p.dtype for p in model.parameters()}, hinted) == ({torch.float32}, [])


def test_extra_fp32_holders_are_marked_to_compute_in_fp32() -> None:
    sinks = meta_model("gpt_oss").get_submodule("model.layers.0.self_attn").sinks
    assert sinks._hf_compute_dtype == torch.float32


def test_strict_fp32_holders_stay_fp32_compute_under_fp32_master_weights() -> None:
    gate = hf_zoo.nemotron_h("meta", torch.float32).get_submodule("model.layers.2.mixer.gate")
    assert gate.weight._hf_compute_dtype == torch.float32


def test_strict_fp32_buffer_is_stored_fp32() -> None:
    gate = meta_model("nemotron_h").get_submodule("model.layers.2.mixer.gate")
    assert gate.e_score_correction_bias.dtype == torch.float32


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_non_strict_keep_in_fp32_applies_to_fp16_loads_only(dtype: torch.dtype, expected: torch.dtype) -> None:
    model = hf_zoo.gpt_oss("meta", dtype)
    assert model.get_submodule("model.norm").weight.dtype == expected


def test_qwen3_tp_plan_is_root_relative_with_head_and_embedding_rules() -> None:
    plan = hf_tp_plan(meta_model("qwen3_tied"))
    expected = {
        "lm_head": "colwise_gather_output",
        "model.embed_tokens": "embedding_rowwise",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    }
    assert {k: plan.get(k) for k in expected} == expected


def test_qwen3_per_head_norms_reduce_with_sum() -> None:
    assert hf_replica_reductions(meta_model("qwen3_tied")) == {
        "model.layers.*.self_attn.q_norm": "sum",
        "model.layers.*.self_attn.k_norm": "sum",
    }


def test_qwen3_tied_head_names_the_embedding_as_canonical() -> None:
    assert hf_tied_weights(meta_model("qwen3_tied")) == {"lm_head.weight": "model.embed_tokens.weight"}


def test_untied_model_declares_no_tied_weights() -> None:
    assert hf_tied_weights(meta_model("llama")) == {}


def test_gemma3_multimodal_plan_and_tie_are_prefixed_through_the_language_model() -> None:
    model = meta_model("gemma3_multimodal")
    assert (
        hf_tp_plan(model)["model.language_model.layers.*.self_attn.q_proj"],
        hf_tied_weights(model),
    ) == ("colwise", {"lm_head.weight": "model.language_model.embed_tokens.weight"})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen3_moe", ("model.layers.*.mlp.experts",)),
        ("gpt_oss", ("model.layers.*.mlp.experts",)),
        ("nemotron_h", ("model.layers.*.mixer.experts",)),
        ("llama", ()),
    ],
)
def test_expert_modules_are_read_from_the_plans(name: str, expected: tuple[str, ...]) -> None:
    assert hf_expert_modules(meta_model(name)) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("nemotron_h", ("e_score_correction_bias", "gate.weight")),
        ("kimi_linear", ("dt_bias", "e_score_correction_bias", "gate.weight")),
        ("gpt_oss", ()),
    ],
)
def test_bf16_compute_pins_the_strict_fp32_tokens(name: str, expected: tuple[str, ...]) -> None:
    assert hf_fp32_compute_tokens(meta_model(name), torch.bfloat16) == expected


def test_kimi_forget_gate_mixes_storage_dtypes_in_its_direct_parameters() -> None:
    gate = meta_model("kimi_linear").get_submodule("model.layers.0.self_attn.forget_gate")
    assert {n: p.dtype for n, p in gate.named_parameters(recurse=False)} == {
        "dt_bias": torch.float32,
        "A_log": torch.bfloat16,
    }


def test_unknown_model_type_lists_close_matches() -> None:
    with pytest.raises(ValueError, match=r"unknown model type 'lama'.*llama"):
        build_hf_model("lama")


def test_build_from_a_local_config_json(tmp_path: Path) -> None:
    meta_model("llama").config.save_pretrained(tmp_path)
    model = build_hf_model(str(tmp_path / "config.json"), {"num_hidden_layers": 1})
    assert (type(model).__name__, model.config.num_hidden_layers) == ("LlamaForCausalLM", 1)
