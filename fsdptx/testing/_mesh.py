"""Fake-process-group meshes: any world size, one process, no GPU."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ._fake_backend import FAKE_BACKEND, FakeStore, forget_world

__all__ = ["fake_mesh"]


@contextmanager
def fake_mesh(shape: Sequence[int], names: Sequence[str], rank: int = 0) -> Iterator[DeviceMesh]:
    """A CPU ``DeviceMesh`` of ``prod(shape)`` fake ranks, seen from ``rank``.

    ``fully_shard``, DTensor and collectives all work; collectives do not
    communicate (an all-reduce returns the local input), which is what lets a
    single process stand in for any rank of any world size. The default
    process group is destroyed on exit, also when the body raises, and
    DTensor's caches are cleared, so the next fake world starts afresh.

    Args:
        shape: the mesh shape.
        names: the mesh dim names.
        rank: the rank this process plays.

    Yields:
        The ``DeviceMesh``.

    Raises:
        ValueError: ``shape`` and ``names`` differ in length or are empty, a
            dim is below 1, or ``rank`` is outside the world.
        RuntimeError: a default process group already exists.

    Example::

        with fsdptx.testing.fake_mesh((2, 4), ("dp", "tp"), rank=5) as mesh:
            fsdptx.apply_plan(p, model, mesh)
    """
    shape = tuple(int(s) for s in shape)
    names = tuple(names)
    if len(shape) != len(names) or not shape:
        raise ValueError(f"fake_mesh: shape {shape} and names {names} must be non-empty and of equal length")
    if any(s < 1 for s in shape):
        raise ValueError(f"fake_mesh: every mesh dimension must be >= 1, got {shape}")
    world = math.prod(shape)
    if not 0 <= rank < world:
        raise ValueError(f"fake_mesh: rank {rank} is outside a world of {world}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_mesh: a default process group is already initialized in this process; "
            "destroy it first (torch.distributed.destroy_process_group())"
        )
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()
        forget_world()
