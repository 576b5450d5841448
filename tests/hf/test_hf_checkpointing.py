"""Activation checkpointing on a Hugging Face model as it ships
(``config.use_cache=True``): a training forward that fills a KV cache
recomputes a different op sequence in backward, which checkpointing cannot
replay, so applying checkpointing turns the cache off with a warning (as
Hugging Face's gradient checkpointing and the reference do); checkpointed
gradients then equal plain ones."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import fsdptx  # noqa: E402
from fsdptx.testing import fake_mesh  # noqa: E402

import hf_zoo  # noqa: E402


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return hf_zoo.llama("cpu", torch.float32)


def _grads(model: nn.Module, activation_checkpointing: object) -> dict[str, torch.Tensor]:
    with fake_mesh((1,), ("dp",)) as mesh:
        config = fsdptx.FSDP2Config(mp_policy=None, activation_checkpointing=activation_checkpointing)  # type: ignore[arg-type]
        fsdptx.FSDP2Manager(config, mesh).parallelize(model)
        ids = torch.randint(0, 120, (2, 8), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids).logits.sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("name", "holder"),
    [
        ("llama", ""),
        # The language model reads its text config; the top-level one has no use_cache.
        ("gemma3_multimodal", "model.language_model"),
    ],
)
def test_checkpointing_turns_the_kv_cache_off_with_a_warning_naming_the_switch(
    name: str, holder: str, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = hf_zoo.ZOO[name]("cpu", torch.float32)
    with fake_mesh((1,), ("dp",)) as mesh, caplog.at_level(logging.WARNING, logger="fsdptx.apply._checkpoint"):
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(activation_checkpointing="selective"), mesh)
        manager.parallelize(model)
    switch = f"model.{holder}.config.use_cache" if holder else "model.config.use_cache"
    assert f"set {switch} = False" in caplog.text
    assert model.get_submodule(holder).config.use_cache is False


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_gradients_with_the_kv_cache_off_equal_plain_ones(mode: str) -> None:
    plain = _grads(_llama(), False)
    checkpointed = _grads(_llama(), mode)  # the cache is on as shipped; checkpointing turns it off
    assert checkpointed.keys() == plain.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)
