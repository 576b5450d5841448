"""The stand-in for a pipeline part another stage holds.

Its own module so the model index can leave gaps out of glob matches
without importing the stage builder (:mod:`fsdptx.model._stages`)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["StageGap"]


class StageGap(nn.Module):
    """Stands in for a part another stage holds: returns its first input.

    On a stage after the first, the embedding's place receives the previous
    stage's activation and hands it on; on a stage before the last, the
    final norm and head pass the stage's output through. It holds no
    tensors, so state dicts and FSDP see nothing of it.

    Attributes:
        stands_for: the FQN of the part it replaces.
    """

    def __init__(self, stands_for: str) -> None:
        super().__init__()
        self.stands_for = stands_for

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        return x

    def extra_repr(self) -> str:
        return f"stands_for={self.stands_for!r}"
