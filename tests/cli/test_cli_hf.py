"""``--hf``: any installed transformers architecture, built on meta with the
dtypes loading gives, planned and reported like a preset."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fsdptx.cli._main import main
from fsdptx.cli._run import parse_hf_config

pytest.importorskip("transformers")

TINY = (
    "num_hidden_layers=3,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=2,"
    "vocab_size=256"
)
LLAMA_70B = (
    "num_hidden_layers=80,hidden_size=8192,intermediate_size=28672,num_attention_heads=64,num_key_value_heads=8"
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)
    return data


# --------------------------------------------------------------------------- --hf-config values


def test_hf_config_values_parse_as_int_float_bool_or_string() -> None:
    assert parse_hf_config(["a=2,b=1e-5,c=true,d=False,e=silu", "f=0.5"]) == {
        "a": 2,
        "b": 1e-5,
        "c": True,
        "d": False,
        "e": "silu",
        "f": 0.5,
    }


def test_malformed_hf_config_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--hf", "llama", "--hf-config", "hidden_size")
    assert (code, out) == (2, "")
    assert err.startswith("fsdptx: error: malformed --hf-config 'hidden_size'") and len(err.splitlines()) == 1


# --------------------------------------------------------------------------- building


def test_hf_model_is_planned_with_its_declared_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "--hf", "llama", "--hf-config", TINY, "--mesh", "dp=2")
    assert data["model"] == "llama (LlamaForCausalLM, bf16)"
    assert [u["modules"][0] for u in data["units"]] == ["model.layers.0", "model.layers.1", "model.layers.2", ""]


@pytest.mark.parametrize(("flag", "storage"), [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32")])
def test_dtype_sets_the_storage_dtype_as_loading_would(
    capsys: pytest.CaptureFixture[str], flag: str, storage: str
) -> None:
    data = run_json(capsys, "--hf", "llama", "--hf-config", TINY, "--dtype", flag, "--mesh", "dp=2")
    assert {u["storage_dtype"] for u in data["units"]} == {storage}


def test_hf_model_with_tp_uses_its_declared_tp_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--hf", "llama", "--hf-config", TINY, "--mesh", "dp=2,tp=2")
    assert code == 0, err
    assert re.search(r"model\.layers\.\{0\.\.2\}\.self_attn\.q_proj\s+colwise", out), out


def test_hf_config_json_path_is_read_locally(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path)
    data = run_json(capsys, "--hf", str(tmp_path / "config.json"), "--mesh", "dp=2")
    assert [u["modules"][0] for u in data["units"]] == ["model.layers.0", "model.layers.1", ""]


def test_unknown_model_type_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--hf", "lama")
    assert (code, out) == (2, "")
    assert "unknown model type 'lama'" in err and len(err.splitlines()) == 1


def test_missing_transformers_names_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    code, out, err = run(capsys, "--hf", "llama")
    assert (code, out) == (2, "")
    assert 'pip install "fsdptx[hf]"' in err and len(err.splitlines()) == 1


def test_layers_with_hf_points_to_hf_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--hf", "llama", "--layers", "2")
    assert code == 2 and "--hf-config num_hidden_layers=N" in err


# --------------------------------------------------------------------------- the 70B check


def test_llama_70b_on_dp8_holds_an_eighth_of_the_model_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    data = run_json(capsys, "--hf", "llama", "--hf-config", LLAMA_70B, "--mesh", "dp=8")
    elapsed = time.perf_counter() - start
    m = data["memory"]
    assert data["applied"] == "full"
    assert data["model_bytes"] == 68_976_648_192 * 2  # bf16
    assert m["params_bytes"] == data["model_bytes"] // 8 + m["padding_bytes"]
    assert m["padding_bytes"] == 0
    assert m["optimizer_bytes"] == 2 * data["model_bytes"] // 8  # AdamW's two states in the bf16 of the params
    assert elapsed < 30, f"70B dry run took {elapsed:.1f} s"

    code, out, _ = run(capsys, "--hf", "llama", "--hf-config", LLAMA_70B, "--mesh", "dp=8")
    assert code == 0
    assert f"({m['params_bytes']:,} B = {data['model_bytes']:,} B / 8 shards + 0 B padding)" in out
    assert re.search(r"^block\s+model\.layers\.\{0\.\.78\} \(79 units\)\s", out, re.M)
    assert re.search(r"^block\s+model\.layers\.79\s.*False", out, re.M)
    for row in ("gradients", "optimizer (adamw", "largest all-gathered unit", "peak forward", "peak backward"):
        assert f"\n  {row}" in out


def test_typo_in_an_hf_config_key_names_the_close_match(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hf", "llama", "--hf-config", "num_hiden_layers=2"]) == 2
    err = capsys.readouterr().err
    assert "has no field 'num_hiden_layers'; did you mean 'num_hidden_layers'?" in err


def test_negative_layer_count_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hf", "llama", "--hf-config", "num_hidden_layers=-1"]) == 2
    assert "num_hidden_layers must be >= 1" in capsys.readouterr().err


def test_build_hf_model_names_overrides_of_the_wrong_type() -> None:
    from fsdptx.hf import build_hf_model

    with pytest.raises(TypeError, match="build_hf_model: overrides must be a mapping"):
        build_hf_model("llama", "hidden_size=32")  # type: ignore[arg-type]


def test_build_hf_model_refuses_a_typo_in_a_config_key() -> None:
    from fsdptx.hf import build_hf_model

    with pytest.raises(ValueError, match="did you mean 'num_hidden_layers'"):
        build_hf_model("llama", {"num_hiden_layers": 2})


def test_stock_bert_lm_head_model_plans(capsys: pytest.CaptureFixture[str]) -> None:
    config = "is_decoder=true,num_hidden_layers=2,hidden_size=32,intermediate_size=64,num_attention_heads=4,vocab_size=64"
    assert main(["plan", "--hf", "bert", "--hf-config", config, "--mesh", "dp=2"]) == 0
    assert "BertLMHeadModel" in capsys.readouterr().out


def test_selective_checkpointing_dry_run_of_an_hf_model_turns_the_cache_off_and_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = "num_hidden_layers=2,hidden_size=64,intermediate_size=128,num_attention_heads=4,num_key_value_heads=4,vocab_size=128"
    assert main(["plan", "--hf", "llama", "--hf-config", config, "--ac", "selective", "--mesh", "dp=2"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out


def test_deepseek_v3_on_dp2_tp2_holds_a_quarter_of_its_tp_split_weights_and_half_of_the_rest_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The routed experts are 95% of DeepSeek-V3's weights: its plan splits
    them over TP (each expert's gate|up per half, its down projection by
    input column) beside the dense MLPs, the shared experts, the embedding
    and the head. Everything else (MLA attention, norms, routers) is a TP
    replica, split over the 2 FSDP ranks only. Expected from the model:
    sum(split) / 4 + sum(replicated) / 2, within 0.1% (FSDP's padding)."""
    import torch

    from fsdptx.hf import build_hf_model

    model = build_hf_model("deepseek_v3", {}, dtype=torch.bfloat16, device="meta")
    tp_split = re.compile(r"(\.mlp\.experts\.|_proj\.weight$|embed_tokens\.weight$|^lm_head\.weight$)")
    attention = re.compile(r"\.self_attn\.")
    split = replicated = 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if tp_split.search(name) and not attention.search(name):
            split += nbytes
        else:
            replicated += nbytes
    expected = split / 4 + replicated / 2

    data = run_json(capsys, "--hf", "deepseek_v3", "--mesh", "dp=2,tp=2")
    assert data["model_bytes"] == split + replicated
    assert split > 0.95 * data["model_bytes"]
    got = data["memory"]["params_bytes"]
    assert abs(got - expected) <= 1e-3 * expected, f"{got:,} B per rank, expected {expected:,.0f} B"


@pytest.mark.parametrize(
    "mesh",
    [("--mesh", "dp=2"), ("--mesh", "pp=2,dp=2", "--schedule", "GPipe", "--microbatches", "1")],
    ids=["step", "pipeline-stages"],
)
def test_a_traced_step_without_kv_cache_holds_no_seq_by_seq_mask(
    capsys: pytest.CaptureFixture[str], mesh: tuple[str, ...]
) -> None:
    """Checkpointing (and a pipeline stage) runs a transformers model
    without a KV cache, which then checks the position ids for packed
    sequences; a GPU run finds none and attends with ``is_causal``. The
    trace must too: a ``batch x seq x seq`` mask would make the saved
    activations grow faster than the sequence (at 4096 tokens it is 16 MiB,
    as much again as everything else saved)."""

    def activations(seq: int) -> int:
        data = run_json(capsys, "--hf", "llama", "--hf-config", TINY, *mesh, "--ac", "full", "--batch", "1", "--seq", str(seq))
        stages = data.get("stages")
        return sum(s["memory"]["activations_bytes"] for s in stages) if stages else int(data["memory"]["activations_bytes"])

    short, long = activations(2048), activations(4096)
    assert long <= 2 * short + 4096, (short, long)
