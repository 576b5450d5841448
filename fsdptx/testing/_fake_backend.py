"""The fake process-group backend and what a fake world leaves behind.

Importing torch's ``fake_pg`` module (through
:mod:`fsdptx.core._torch_internals`, where every private torch name lives)
registers the ``fake`` backend; its ``FakeStore`` is the key-value store the
backend expects.
"""

from __future__ import annotations

from ..core._torch_internals import FakeStore, clear_dtensor_caches

__all__ = ["FAKE_BACKEND", "FakeStore", "forget_world"]

FAKE_BACKEND = "fake"


def forget_world() -> None:
    """Drop what DTensor cached about the world that just closed.

    DTensor keys its sharding-propagation, redistribution-plan and mesh
    topology caches by mesh layout, not by process group, so a later world
    whose meshes look alike would reuse decisions (and destroyed groups) of
    an earlier one: a test then fails or passes depending on which test ran
    before it in the process.
    """
    clear_dtensor_caches()
