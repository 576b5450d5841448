"""The plain FSDPMemTracker recipe for one pipeline stage of the ``llama``
preset: the independent figures the dry run's traced stage step is checked
against (``tests/cli/test_cli_pipeline_memory.py``).

The stage is built the way a training job builds it: ``FSDP2Manager``
``.parallelize(model, loss_fn=...)`` on a fake mesh seen from a rank of the
stage's pipeline coordinate, which runs ``fsdptx.apply_pipeline`` and wraps
the stage in torch's ``PipelineStage``. Then, in ``FakeTensorMode`` under a
plain ``FSDPMemTracker``, two steps of the micro-batches in the order the
caller writes out (``"F0 F1 B0 ..."``), each backward with FSDP's gradient
sync off as torch's pipeline stages run it, torch's own
``perform_reduce_grad`` after the last backward, and an AdamW step; the
second step's snapshots are the figures. Received inputs and output
gradients live in one buffer per micro-batch, as torch allocates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from fsdptx.core._torch_internals import own_propagation_fake_mode
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh

__all__ = ["StageReference", "loss", "stage_tracker_reference"]


@dataclass(frozen=True)
class StageReference:
    """Bytes per rank the tracker measured for one stage's step."""

    params: int
    grads: int
    optimizer: int
    activations: int  # saved for backward at the end of the forward the order holds the most after
    peak: int


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss both pipeline recipes run: fp32 cross entropy over every token."""
    return nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def stage_tracker_reference(
    layers: int,
    seq: int,
    shape: Sequence[int],
    names: Sequence[str],
    config: FSDP2Config,
    *,
    pp_rank: int,
    order: str,
    hidden: tuple[int, ...],
) -> StageReference:
    """``order``: the stage's forwards and backwards, ``"F0 F1 B0 F2 ..."``;
    ``hidden``: the shape of one micro-batch's activation between stages
    (what the stage receives and sends), one sequence per micro-batch."""
    assert names[0] == "pp", "the recipe reads the pipeline coordinate off dim 0"
    actions = [(a[0], int(a[1:])) for a in order.split()]
    m = sum(1 for kind, _ in actions if kind == "F")
    with torch.device("meta"):
        model = build_preset("llama", layers)
    rank = pp_rank * (math.prod(shape) // shape[0])
    with fake_mesh(shape, names, rank=rank) as mesh:
        stages = FSDP2Manager(config, mesh).parallelize(model, loss_fn=loss)
        assert not isinstance(stages, nn.Module)
        (module,) = stages.modules
        (torch_stage,) = stages.stages
        with FakeTensorMode(allow_non_fake_inputs=True), own_propagation_fake_mode():
            module.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, foreach=True)
            if stages.is_first:
                inputs = list(torch.randint(0, 32000, (m, seq)).tensor_split(m))
            else:
                inputs = [torch.empty(hidden, dtype=torch.bfloat16) for _ in range(m)]
            labels = list(torch.randint(0, 32000, (m, seq)).tensor_split(m))
            grads = [torch.empty(hidden, dtype=torch.bfloat16) for _ in range(m)]
            tracker = FSDPMemTracker(module, optimizer)
            tracker.track_inputs((inputs, labels, grads))
            with tracker:
                for step in range(2):
                    at_start = tracker.get_tracker_snapshot()
                    held: dict[int, torch.Tensor] = {}
                    most = 0
                    for kind, i in actions:
                        if kind == "F":
                            tracker.reset_mod_stats()
                            x = inputs[i] if stages.is_first else inputs[i].requires_grad_(True)
                            out = module(x)
                            # torch's stage keeps the output until its backward; the last one's loss too
                            held[i] = (loss(out, labels[i]), out) if stages.is_last else (out, out)
                            del out
                            snapshot = tracker.get_tracker_snapshot()
                            (dev,) = snapshot
                            most = max(most, snapshot[dev]["Activation"])
                        else:
                            module.set_is_last_backward(False)
                            module.set_reshard_after_backward(False)
                            module.set_requires_gradient_sync(False)
                            root, output = held.pop(i)  # torch keeps the output through the backward
                            if stages.is_last:
                                root.backward()
                            else:
                                root.backward(grads[i])
                            del root, output
                    torch_stage.perform_reduce_grad(m)
                    after_reduce = tracker.get_tracker_snapshot()
                    optimizer.step()
                    optimizer.zero_grad()
                    for x in inputs:  # as the schedule's next step begins
                        x.grad = None
                    if step == 0:
                        tracker.reset_mod_stats()
                        first_most = most
                peak = tracker.get_tracker_snapshot("peak")
    (dev,) = peak
    assert most == first_most, "both steps hold the same activations"
    return StageReference(
        params=at_start[dev]["Sharded Param"],
        grads=after_reduce[dev]["Sharded Grad"],
        optimizer=at_start[dev]["OptState"],
        activations=most,
        peak=peak[dev]["Total"],
    )
