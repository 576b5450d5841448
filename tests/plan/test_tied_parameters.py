"""A parameter tied between a declared block and a module outside it is
owned by their common unit: stock BERT (``BertLMHeadModel``: the decoder
tied to ``word_embeddings``, ``BertEmbeddings`` in ``_no_split_modules``)
plans, applies and runs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.hf import build_hf_model  # noqa: E402
from fsdptx.testing import fake_mesh  # noqa: E402

TINY_BERT = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "vocab_size": 64,
    "is_decoder": True,
}


def test_bert_lm_head_tied_to_embeddings_plans_with_the_tie_in_the_root_unit() -> None:
    model = build_hf_model("bert", TINY_BERT, dtype=torch.float32, device="meta")
    assert type(model).__name__ == "BertLMHeadModel"
    p = fsdptx.plan(model, fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks))
    owner = p.owned_params
    assert p.units[owner["bert.embeddings.word_embeddings.weight"]].modules == ("",)
    assert [u.modules[0] for u in p.units if u.kind == "block"] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]


def test_bert_lm_head_model_applies_and_runs_on_a_fake_mesh() -> None:
    torch.manual_seed(0)
    model = build_hf_model("bert", TINY_BERT, dtype=torch.float32, device="cpu")
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(mp_policy=None), mesh).parallelize(model)
        logits = model(input_ids=torch.randint(0, 64, (2, 8))).logits
    assert logits.shape == (2, 8, 64) and torch.isfinite(logits).all()
    assert model.bert.embeddings.word_embeddings.weight is model.cls.predictions.decoder.weight
