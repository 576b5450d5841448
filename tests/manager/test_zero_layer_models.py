"""A model with zero layers (an empty block list) gets a clear answer: what
needs blocks (checkpointing, sequence parallelism, reduction marks declared
on the blocks) is refused before any change, saying the model has zero
layers; plain TP of what is there (embedding, head) applies."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx import FSDP2Config, FSDP2Manager
from fsdptx.presets import llama
from fsdptx.testing import fake_mesh

from unchanged import assert_unchanged, state_of

ZERO_LAYERS = r"\('layers' holds no modules: the model has zero layers\)"

_REFUSED = {
    "tp": ({"mp_policy": None}, r"mark_reduction: reduction glob 'layers\.\*\.attn_norm' matches no module"),
    "sp": ({"sequence_parallel": True}, r"tensor_parallel: sequence_parallel=True, but no blocks were found"),
    "ac": ({"activation_checkpointing": True}, r"checkpoint_activations: found no blocks in Decoder"),
}


@pytest.mark.parametrize("case", list(_REFUSED))
def test_a_zero_layer_llama_preset_is_refused_unchanged_saying_it_has_zero_layers(case: str) -> None:
    settings, match = _REFUSED[case]
    model = llama(layers=0)
    before = state_of(model)
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(fsdptx.PlanningError, match=f"{match}.*{ZERO_LAYERS}"):
            FSDP2Manager(FSDP2Config(**settings), mesh).parallelize(model)
    assert_unchanged(before, state_of(model))


def _hf_llama_without_layers() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=0,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16,
    )
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"sequence_parallel": True}, "tensor_parallel: sequence_parallel=True, but no blocks were found"),
        ({"activation_checkpointing": True}, "checkpoint_activations: found no blocks in LlamaForCausalLM"),
    ],
    ids=["sp", "ac"],
)
def test_a_zero_layer_hf_llama_refuses_what_needs_blocks_unchanged(settings: dict[str, Any], match: str) -> None:
    model = _hf_llama_without_layers()
    before = state_of(model)
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        with pytest.raises(fsdptx.PlanningError, match=rf"{match}.*\('model\.layers' holds no modules"):
            FSDP2Manager(FSDP2Config(**settings), mesh).parallelize(model)
    assert_unchanged(before, state_of(model))


def test_a_zero_layer_hf_llama_gets_tensor_parallelism_of_its_embedding_and_head() -> None:
    model = _hf_llama_without_layers()
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        manager = FSDP2Manager(FSDP2Config(mp_policy=None), mesh)
        p = manager.plan(model)
        manager.parallelize(model)
        assert isinstance(model.lm_head.weight, DTensor)
    assert p.tensor_parallel is not None
    assert {a.module for a in p.tensor_parallel.assignments} == {"model.embed_tokens", "lm_head"}
