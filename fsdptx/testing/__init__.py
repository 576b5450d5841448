"""Test kit: fake-process-group meshes, a collective recorder, a gloo
multi-process runner for real numerics on CPU, and (in
``fsdptx.testing.strategies``, needs Hypothesis) random module trees and mesh
shapes, and ``mark_sharded``, a ``shard_module`` that only marks modules as
sharded. Installed with fsdptx, the pytest plugin exposes them as fixtures."""

from ._collectives import Collective, record_collectives
from ._gloo import DistributedTestError, free_port, run_distributed
from ._mesh import fake_mesh
from ._primitives import mark_sharded
from ._replicas import assert_replicas_in_sync

__all__ = [
    "Collective",
    "DistributedTestError",
    "assert_replicas_in_sync",
    "fake_mesh",
    "free_port",
    "mark_sharded",
    "record_collectives",
    "run_distributed",
]
