"""``FSDP2Manager.maybe_compile`` and ``patch_is_packed_sequence``.

Compilation is checked where it is decided (each block's call is replaced
by a compiled one, in place), without running a forward through inductor,
which would need a C++ toolchain and minutes on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh


def small() -> Decoder:
    return Decoder(DecoderConfig(vocab=16, dim=8, hidden=16, layers=2))


def compiled(module: nn.Module) -> bool:
    return module._compiled_call_impl is not None


@pytest.fixture
def restore_micro_pipeline_tp() -> Iterator[None]:
    saved = torch._inductor.config._micro_pipeline_tp
    yield
    torch._inductor.config._micro_pipeline_tp = saved


def test_maybe_compile_leaves_the_model_alone_without_compile_or_async_tp() -> None:
    model = small()
    with fake_mesh((2,), ("dp",)) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(), mesh).maybe_compile(model)
    assert not any(compiled(m) for m in model.modules())


def test_maybe_compile_compiles_each_block_in_place_keeping_fqns() -> None:
    model = small()
    before = [n for n, _ in model.named_parameters()]
    with fake_mesh((2,), ("dp",)) as mesh:
        manager = fsdptx.FSDP2Manager(fsdptx.FSDP2Config(enable_compile=True, mp_policy=None), mesh)
        manager.parallelize(model)
        assert manager.maybe_compile(model) is model
    assert [compiled(b) for b in model.layers] == [True, True]
    assert not compiled(model)
    assert [n for n, _ in model.named_parameters()] == before


def test_async_tp_turns_on_micro_pipelined_tp_and_says_when_symmetric_memory_is_unavailable(
    caplog: pytest.LogCaptureFixture, restore_micro_pipeline_tp: None
) -> None:
    torch._inductor.config._micro_pipeline_tp = False
    config = fsdptx.FSDP2Config(sequence_parallel=True, enable_async_tensor_parallel=True)
    with fake_mesh((2, 2), ("dp", "tp")) as mesh, caplog.at_level(logging.WARNING, logger="fsdptx.manager"):
        fsdptx.FSDP2Manager(config, mesh).maybe_compile(small())
    assert torch._inductor.config._micro_pipeline_tp is True
    assert "symmetric memory not enabled" in caplog.text


def test_patch_is_packed_sequence_makes_the_check_false_and_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    fa = pytest.importorskip("transformers.modeling_flash_attention_utils")
    monkeypatch.setattr(fa, "_is_packed_sequence", fa._is_packed_sequence)  # restored after the test
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert bool(fa._is_packed_sequence(packed, 1)) is True
    assert fsdptx.patch_is_packed_sequence() is True
    patched = fa._is_packed_sequence
    assert patched(packed, 1) is False
    assert fsdptx.patch_is_packed_sequence() is True
    assert fa._is_packed_sequence is patched


def test_parallelize_patches_the_packed_sequence_check_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    fa = pytest.importorskip("transformers.modeling_flash_attention_utils")
    original = fa._is_packed_sequence
    monkeypatch.setattr(fa, "_is_packed_sequence", original)
    with fake_mesh((2,), ("dp",)) as mesh:
        config = fsdptx.FSDP2Config(patch_is_packed_sequence=True, mp_policy=None)
        fsdptx.FSDP2Manager(config, mesh).parallelize(small())
    assert fa._is_packed_sequence is not original
    assert fa._is_packed_sequence(torch.tensor([[0, 1, 0, 1]]), 1) is False
