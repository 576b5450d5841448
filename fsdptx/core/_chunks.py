"""Gradient chunking: split tensors into communication buffers of bounded size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from ._args import require_positive_int
from ._dtypes import gradient_reduce_dtype

__all__ = ["DEFAULT_MAX_BUFFER_BYTES", "gradient_chunks"]

DEFAULT_MAX_BUFFER_BYTES = 256 * 2**20


def gradient_chunks(
    tensors: Sequence[torch.Tensor], max_bytes: int = DEFAULT_MAX_BUFFER_BYTES
) -> Iterator[list[torch.Tensor]]:
    """Split ``tensors`` in order into chunks whose communication size is at
    most ``max_bytes``.

    Each element is budgeted at its communication size
    (:func:`gradient_reduce_dtype`), so a bf16 gradient costs 4 bytes per
    element: the fp32 buffer it is reduced in is what occupies memory.

    Chunks are filled greedily: a tensor that fits the room left is yielded
    whole (the same object); one that does not is cut into flat views
    (``t.view(-1)[a:b]``) that fill the current chunk and continue in the next.
    So every chunk but the last is full to within one element, the number of
    chunks is the least the budget allows, and no buffer ever exceeds
    ``max_bytes``, even for a single tensor larger than the budget: peak extra
    memory is bounded by the budget, not by the largest tensor. Writing into a
    view writes into its tensor, which is how reduced values get back.
    Tensors that must be cut need to be contiguous.

    ``max_bytes`` is checked at the call, not at the first ``next()``: a
    generator would only raise once iterated, far from the mistake.

    Args:
        tensors: the gradients (or any tensors) to communicate, in the order
            every rank uses.
        max_bytes: the most bytes one buffer may take, counted at the
            communication dtype; a positive int.

    Returns:
        An iterator of chunks, each a list of whole tensors and flat views.

    Raises:
        TypeError: ``max_bytes`` is not an int.
        ValueError: ``max_bytes`` is not positive (at the call), cannot hold
            one element, or a tensor that must be cut is not contiguous (while
            iterating).

    Example::

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for chunk in fsdptx.gradient_chunks(grads, max_bytes=64 * 2**20):
            flat = torch.cat([g.reshape(-1).float() for g in chunk])
    """
    if isinstance(tensors, (str, bytes, torch.Tensor)) or not isinstance(tensors, Iterable):
        raise TypeError(
            f"gradient_chunks: tensors must be a sequence of tensors (a list), got {type(tensors).__name__}"
        )
    return _chunks(tensors, require_positive_int(max_bytes, "max_bytes", "gradient_chunks"))


def _chunks(tensors: Sequence[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """:func:`gradient_chunks` once ``max_bytes`` is known to be a positive int."""
    chunk: list[torch.Tensor] = []
    room = max_bytes
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gradient_chunks: tensors[{index}] must be a torch.Tensor, got {type(tensor).__name__}")
        itemsize = gradient_reduce_dtype(tensor.dtype).itemsize
        if itemsize > max_bytes:
            raise ValueError(
                f"gradient_chunks: max_bytes={max_bytes} cannot hold one {tensor.dtype} element "
                f"(communicated as {itemsize} bytes); raise max_bytes"
            )
        cost = tensor.numel() * itemsize
        if cost > room and room < itemsize:
            # The current chunk cannot take even one element: close it first,
            # so a tensor that fits a fresh chunk is not cut (nor refused
            # for being non-contiguous).
            yield chunk
            chunk, room = [], max_bytes
        if cost <= room:
            chunk.append(tensor)
            room -= cost
            continue
        if not tensor.is_contiguous() and cost <= max_bytes:
            # It cannot be cut, but fits whole in a fresh chunk: put it there,
            # so whether it is accepted never depends on what came before it.
            yield chunk
            chunk, room = [tensor], max_bytes - cost
            continue
        if not tensor.is_contiguous():
            raise ValueError(
                f"gradient_chunks: tensor {index} (shape {tuple(tensor.shape)}) must be split "
                f"across buffers but is not contiguous; pass tensor.contiguous()"
            )
        flat = tensor.view(-1)
        start = 0
        while start < flat.numel():
            take = min(room // itemsize, flat.numel() - start)
            if take == 0:
                yield chunk
                chunk, room = [], max_bytes
                continue
            chunk.append(flat[start : start + take])
            room -= take * itemsize
            start += take
    if chunk:
        yield chunk
