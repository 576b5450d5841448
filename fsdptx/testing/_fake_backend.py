"""The one place fsdptx touches torch's private fake process-group backend.

Importing torch's ``fake_pg`` module registers the ``fake`` backend; its
``FakeStore`` is the key-value store the backend expects. Should torch move
either, only this file changes.
"""

from __future__ import annotations

from torch.testing._internal.distributed.fake_pg import FakeStore

__all__ = ["FAKE_BACKEND", "FakeStore"]

FAKE_BACKEND = "fake"
