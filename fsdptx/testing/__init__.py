"""Test kit: fake-process-group meshes, a collective recorder, and (in
``fsdptx.testing.strategies``, needs Hypothesis) random module trees and mesh
shapes. Installed with fsdptx, the pytest plugin exposes them as fixtures."""

from ._collectives import Collective, record_collectives
from ._mesh import fake_mesh

__all__ = ["Collective", "fake_mesh", "record_collectives"]
