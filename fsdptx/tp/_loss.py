"""Loss parallelism: the cross entropy of vocabulary-sharded logits."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

__all__ = ["loss_parallel"]


def loss_parallel() -> AbstractContextManager[None]:
    """The context to compute the loss in, and run its backward in, when the
    plan keeps the head's logits vocabulary-sharded
    (``FSDP2Config(loss_parallel=True)``): torch's ``loss_parallel``.

    Each TP rank then holds only its vocabulary slice of the logits; the
    cross entropy is computed from the slices with two small all-reduces per
    token (the max and the sum of exponentials) instead of gathering the
    full logits on every rank.

    Returns:
        A context manager; inside it, cross entropy on vocabulary-sharded
        logits is computed from the slices.

    Example::

        logits = model(tokens)                      # a Shard(-1) DTensor
        with fsdptx.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
    """
    return _torch_loss_parallel()
