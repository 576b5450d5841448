"""The one place fsdptx touches torch's private fake process-group backend
and the DTensor caches a fake world leaves behind.

Importing torch's ``fake_pg`` module registers the ``fake`` backend; its
``FakeStore`` is the key-value store the backend expects. Should torch move
any of these, only this file changes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, _redistribute
from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.testing._internal.distributed.fake_pg import FakeStore

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
    # What torch.distributed.tensor.debug._clear_sharding_prop_cache does,
    # without importing that package (it needs numpy).
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _redistribute._gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
