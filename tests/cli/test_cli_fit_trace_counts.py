"""Which block counts ``--fit`` traces: two that differ by one block of the
kind the stack repeats, so their difference is what each further block
adds. A stack that opens with blocks of another kind (DeepSeek-V3's dense
layers before its MoE ones) keeps them in both traced models; traced with
the plain two and three blocks, DeepSeek-V3 had no MoE layer at all and
every candidate under ``--ep`` was refused."""

from __future__ import annotations

import contextlib
import io
import json

import hf_zoo
from fsdptx.cli._fit import TRACE_LAYERS, trace_counts
from fsdptx.cli._main import main
from fsdptx.hf import build_hf_model

TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def test_a_uniform_stack_is_traced_at_two_and_three_blocks() -> None:
    model = build_hf_model("llama", {**TINY_LLAMA, "num_hidden_layers": 8}, device="meta")
    assert trace_counts(model, 8) == (TRACE_LAYERS - 1, TRACE_LAYERS)


def test_a_stack_with_few_blocks_is_traced_whole() -> None:
    model = build_hf_model("llama", {**TINY_LLAMA, "num_hidden_layers": 3}, device="meta")
    assert trace_counts(model, 3) == (3,)
    assert trace_counts(model, None) == (None,)


def test_leading_blocks_of_another_kind_are_kept_in_both_traced_models() -> None:
    model = build_hf_model("deepseek_v3", {**hf_zoo.DEEPSEEK_V3, "num_hidden_layers": 12, "first_k_dense_replace": 3}, device="meta")
    assert trace_counts(model, 12) == (4, 5)  # 3 dense + 1 MoE, 3 dense + 2 MoE
    assert trace_counts(model, 5) == (5,)


def test_a_dense_first_moe_model_fits_with_its_experts_split() -> None:
    config = ",".join(f"{k}={v}" for k, v in {**hf_zoo.DEEPSEEK_V3, "num_hidden_layers": 6, "first_k_dense_replace": 3}.items())
    out, err = io.StringIO(), io.StringIO()
    argv = ["plan", "--hf", "deepseek_v3", "--hf-config", config, "--seq", "64", "--ep", "2", "--fit", "4x8GiB", "--fit-pp", "1", "--json"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    fit = json.loads(out.getvalue())["fit"]
    assert fit["evaluated"] > 0 and fit["fitting"], fit["skipped"]
    assert all(c["moe_mesh"]["ep"] == 2 for c in fit["fitting"])
    assert not any("matches no module" in s for s in fit["skipped"])
