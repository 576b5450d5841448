"""The pytest plugin: installing fsdptx gives downstream suites its fixtures.

These tests request the fixtures by name without importing anything from
``fsdptx.testing.plugin``: they resolve only because the ``pytest11`` entry
point registered the plugin when the package was installed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdptx.testing import Collective


def test_plugin_is_registered_through_the_entry_point(pytestconfig: pytest.Config) -> None:
    assert pytestconfig.pluginmanager.has_plugin("fsdptx")


def test_fake_mesh_fixture_builds_a_mesh_seen_from_the_given_rank(
    fsdptx_fake_mesh: Callable[..., DeviceMesh],
) -> None:
    mesh = fsdptx_fake_mesh((2, 4), ("dp", "tp"), rank=6)
    assert mesh.shape == (2, 4)
    assert dist.get_rank() == 6
    assert dist.get_process_group_ranks(mesh["tp"].get_group()) == [4, 5, 6, 7]


def test_fake_mesh_fixture_tears_the_process_group_down_after_the_test() -> None:
    """Runs after the test above in file order: nothing it set up is left."""
    assert not dist.is_initialized()


def test_collectives_fixture_records_collectives_issued_after_it_starts(
    fsdptx_fake_mesh: Callable[..., DeviceMesh],
    fsdptx_collectives: Callable[[], list[Collective]],
) -> None:
    mesh = fsdptx_fake_mesh((4,), ("dp",), rank=1)
    dist.all_reduce(torch.ones(2), group=mesh.get_group())  # before recording: not listed
    calls = fsdptx_collectives()
    dist.broadcast(torch.ones(3, dtype=torch.bfloat16), src=0, group=mesh.get_group())
    assert [(c.op, c.group, c.shapes, c.dtypes) for c in calls] == [
        ("broadcast_", (0, 1, 2, 3), ((3,),), (torch.bfloat16,))
    ]
