"""Test kit: fake-process-group meshes, a collective recorder, a gloo
multi-process runner for real numerics on CPU, and (in
``fsdptx.testing.strategies``, needs Hypothesis) random module trees and mesh
shapes, and ``mark_sharded``, a ``shard_module`` that only marks modules as
sharded. Installed with fsdptx, the pytest plugin exposes them as fixtures.

Each name is imported from its module on first use: pytest loads the plugin
(:mod:`fsdptx.testing.plugin`) in every run of a suite where fsdptx is
installed, and importing this package must not import torch for it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._collectives import Collective, record_collectives
    from ._gloo import DistributedTestError, free_port, run_distributed
    from ._mesh import fake_mesh
    from ._primitives import mark_sharded
    from ._replicas import assert_replicas_in_sync

# Each name and the module defining it.
_HOMES = {
    "Collective": "._collectives",
    "DistributedTestError": "._gloo",
    "assert_replicas_in_sync": "._replicas",
    "fake_mesh": "._mesh",
    "free_port": "._gloo",
    "mark_sharded": "._primitives",
    "record_collectives": "._collectives",
    "run_distributed": "._gloo",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("..core", __name__)  # imports torch quietly first (see fsdptx.core)
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
