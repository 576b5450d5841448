"""The plain FSDPMemTracker recipe (torchtitan's memory estimation) on the
``llama`` preset: the independent figures fsdptx's memory plan is checked
against, by ``test_memory_plan.py`` at small sizes and by
``benchmarks/memory_check.py`` at large ones.

Parallelize the meta model on a fake mesh, materialize it in
``FakeTensorMode``, run two iterations (forward, fp32 cross entropy,
backward, AdamW) under the tracker; the second iteration's snapshots are the
figures, AdamW's state having been made by the first. The caveat of this
recipe on torch 2.13: DTensor's shape propagation must not run in the
tracked fake mode, or its tensors are counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from fsdptx.core._torch_internals import own_propagation_fake_mode
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

__all__ = ["Reference", "tracked_two_steps", "tracker_reference"]


@dataclass(frozen=True)
class Reference:
    """Bytes per rank the tracker measured."""

    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int


def tracker_reference(
    layers: int, seq: int, shape: Sequence[int], names: Sequence[str], config: FSDP2Config
) -> Reference:
    with torch.device("meta"):
        model = build_preset("llama", layers)
    with fake_mesh(shape, names) as mesh:
        FSDP2Manager(config, mesh).parallelize(model)
        with FakeTensorMode(allow_non_fake_inputs=True), own_propagation_fake_mode():
            model.to_empty(device="cpu")
            tokens = torch.randint(0, 32000, (1, seq))
            labels = torch.randint(0, 32000, (1, seq))
            return tracked_two_steps(model, model, tokens, labels)


def tracked_two_steps(
    model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor
) -> Reference:
    """Two training iterations of the parallelized ``model`` (logits from
    ``forward(tokens)``) under a plain ``FSDPMemTracker``; the second's
    snapshots, AdamW's state having been made by the first."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((tokens, labels))
    with tracker:
        for iteration in range(2):
            at_start = tracker.get_tracker_snapshot()
            logits = forward(tokens)
            loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
            del logits
            before_backward = tracker.get_tracker_snapshot()
            loss.backward()
            after_backward = tracker.get_tracker_snapshot()
            optimizer.step()
            optimizer.zero_grad()
            if iteration == 0:
                tracker.reset_mod_stats()
        peak = tracker.get_tracker_snapshot("peak")
    (dev,) = peak
    return Reference(
        params=at_start[dev]["Sharded Param"],
        grads=after_backward[dev]["Sharded Grad"],
        optimizer=at_start[dev]["OptState"],
        activations=before_backward[dev]["Activation"],
        peak=peak[dev]["Total"],
    )
