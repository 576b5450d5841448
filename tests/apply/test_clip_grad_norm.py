"""``fsdptx.clip_grad_norm_`` in one process: on a plain model it is torch's
``clip_grad_norm_`` (same total norm, same clipped gradients), over model
parts it counts each tied parameter once, and bad arguments are refused
before any gradient changes, naming the argument."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fsdptx
from fsdptx.presets import Decoder, DecoderConfig


def _with_grads(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab=32, dim=16, hidden=32, layers=2))
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(1))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf])
@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clips", "leaves"])
def test_on_a_plain_model_it_is_torchs_clip_grad_norm(norm_type: float, max_norm: float) -> None:
    ours, theirs = _with_grads(), _with_grads()
    total = fsdptx.clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for name, g in _grads(theirs).items():
        torch.testing.assert_close(_grads(ours)[name], g, rtol=1e-6, atol=1e-9, msg=name)


def test_over_model_parts_a_tied_parameter_counts_once() -> None:
    model = _with_grads()
    model.lm_head.weight = model.embed_tokens.weight  # tied: one tensor reachable from two parts
    model.embed_tokens.weight.grad = torch.ones_like(model.embed_tokens.weight)
    reference = _grads(model)
    parts = [model.embed_tokens, model.lm_head, model.layers, model.norm]
    total = fsdptx.clip_grad_norm_(parts, 1e9)
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference.values()]))
    torch.testing.assert_close(total, want.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((1.0, 1.0), {}, TypeError, "model_or_stages must be an nn.Module"),
        (("model", -1.0), {}, ValueError, "max_norm must be >= 0"),
        (("model", float("nan")), {}, TypeError, "max_norm must be a number"),
        (("model", True), {}, TypeError, "max_norm must be a number"),
        (("model", 1.0, 0.0), {}, ValueError, "norm_type must be positive"),
        (("model", 1.0, "2"), {}, TypeError, "norm_type must be a number"),
        (("model", 1.0), {"error_if_nonfinite": 1}, TypeError, "error_if_nonfinite must be a bool"),
    ],
)
def test_bad_arguments_are_refused_naming_them_with_gradients_unchanged(
    args: tuple[object, ...], kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    model = _with_grads()
    before = _grads(model)
    call = tuple(model if a == "model" else a for a in args)
    with pytest.raises(error, match=f"clip_grad_norm_: {words}"):
        fsdptx.clip_grad_norm_(*call, **kwargs)  # type: ignore[arg-type]
    for name, g in _grads(model).items():
        assert torch.equal(g, before[name]), name


def test_a_non_finite_norm_with_error_if_nonfinite_raises_and_leaves_the_gradients() -> None:
    model = _with_grads()
    model.norm.weight.grad[0] = math.inf
    before = _grads(model)
    with pytest.raises(RuntimeError, match="total norm of order 2.0 is inf; gradients left unchanged"):
        fsdptx.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    for name, g in _grads(model).items():
        assert torch.equal(g, before[name]), name
