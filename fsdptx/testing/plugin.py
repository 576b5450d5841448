"""pytest plugin (entry point ``fsdptx``): fixtures for downstream test suites.

Installing fsdptx makes these fixtures available in any pytest run; torch is
imported only when a fixture is used, so the plugin costs nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._collectives import Collective


@pytest.fixture
def fsdptx_fake_mesh() -> Iterator[Callable[..., DeviceMesh]]:
    """A factory ``(shape, names, rank=0) -> DeviceMesh`` on a fake process
    group, torn down after the test (one mesh per test at a time)."""
    from ._mesh import fake_mesh

    with ExitStack() as stack:

        def make(shape: Sequence[int], names: Sequence[str], rank: int = 0) -> DeviceMesh:
            return stack.enter_context(fake_mesh(shape, names, rank))

        yield make


@pytest.fixture
def fsdptx_collectives() -> Iterator[Callable[[], list[Collective]]]:
    """A factory returning a list that records every collective issued from
    then until the end of the test."""
    from ._collectives import record_collectives

    with ExitStack() as stack:

        def start() -> list[Collective]:
            return stack.enter_context(record_collectives())

        yield start
