"""Blocks the caller wrapped with ``checkpoint_wrapper`` before fsdptx saw
them run under sequence parallelism on the layout unwrapped blocks run on:
at every module, the same kind of tensor (plain or DTensor), local shape
and placements, read by forward pre-hooks on a fake tp=2 mesh. (The values
of a fake mesh's collectives are meaningless; layouts are not.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig
from fsdptx.testing import fake_mesh

WRAPPER = "._checkpoint_wrapped_module"
Layout = tuple[str, tuple[int, ...], tuple[str, ...]]


def _layout(x: object) -> Layout:
    assert isinstance(x, torch.Tensor)
    if isinstance(x, DTensor):
        return ("DTensor", tuple(x.to_local().shape), tuple(map(str, x.placements)))
    return ("tensor", tuple(x.shape), ())


def _layouts_seen(model: nn.Module, tokens: torch.Tensor) -> dict[str, Layout]:
    seen: dict[str, Layout] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                seen[name.replace(WRAPPER, "")] = _layout(first)

        return record

    for name, module in model.named_modules():
        if name and not name.endswith(WRAPPER):
            module.register_forward_pre_hook(hook(name), with_kwargs=True)
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    seen["<output>"] = _layout(logits)
    return seen


def _run(build: Callable[[], nn.Module], layers: Callable[[nn.Module], nn.ModuleList], wrap: bool) -> dict[str, Layout]:
    torch.manual_seed(0)
    model = build()
    if wrap:
        blocks = layers(model)
        for i, block in enumerate(blocks):
            blocks[i] = checkpoint_wrapper(block)
    with fake_mesh((1, 2), ("dp", "tp")) as mesh:
        fsdptx.FSDP2Manager(fsdptx.FSDP2Config(sequence_parallel=True, mp_policy=None), mesh).parallelize(model)
        return _layouts_seen(model, torch.randint(0, 16, (2, 8)))


def _decoder() -> nn.Module:
    return Decoder(DecoderConfig(vocab=16, dim=16, hidden=32, layers=2))


def _hf_llama() -> nn.Module:
    pytest.importorskip("transformers")
    from hf_zoo import llama

    return llama(device="cpu", dtype=torch.float32)


@pytest.mark.parametrize(
    ("build", "layers"),
    [(_decoder, lambda m: m.layers), (_hf_llama, lambda m: m.model.layers)],
    ids=["decoder", "hf-llama"],
)
def test_checkpoint_wrapped_blocks_run_on_the_layouts_unwrapped_blocks_run_on(
    build: Callable[[], nn.Module], layers: Callable[[nn.Module], nn.ModuleList]
) -> None:
    plain = _run(build, layers, wrap=False)
    wrapped = _run(build, layers, wrap=True)
    assert wrapped == plain
    block = next(name for name in plain if name.endswith("layers.0"))
    assert plain[block][1][1] == 4  # the block takes its half of the 8-token sequence
