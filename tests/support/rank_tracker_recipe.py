"""The plain tracker recipe for one pipeline rank that runs several stages
(interleaved schedules) of the ``llama`` preset: the independent peak that
``--fit``'s modelled interleaved candidates are checked against
(``tests/cli/test_cli_fit_pipeline_and_context.py``).

The rank's stages are built the way a training job builds them:
``FSDP2Manager.parallelize(model, loss_fn=...)`` on a fake mesh seen from
the rank, which gives every stage module (each its own FSDP root), torch's
``PipelineStage`` objects and torch's schedule. The forwards and backwards
run in the order torch's schedule computed for the rank
(``pipeline_order``, the schedule's own warm-up and steady state), in
``FakeTensorMode``, each backward with FSDP's gradient sync off, torch's
``perform_reduce_grad`` per stage after the last backward, one AdamW step
over all the rank's parameters; two steps, the peak over both.

The tracker is torch's ``MemTracker`` with its per-module statistics left
out: ``FSDPMemTracker`` takes one FSDP root and a rank here holds several,
and the per-module statistics refuse a module whose next forward comes
before its backward, which interleaving does. What is left is every
allocation's bytes, which is all the peak needs. On a one-stage rank
(1F1B) it gives ``stage_tracker_recipe``'s FSDPMemTracker peak, to the byte
on the first stage (the last differs by the gradient buffers that recipe
allocates for a stage that receives none).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from fsdptx.core._torch_internals import own_propagation_fake_mode
from fsdptx.manager import FSDP2Config, FSDP2Manager
from fsdptx.presets import build_preset
from fsdptx.testing import fake_mesh
from stage_tracker_recipe import loss

__all__ = ["rank_tracker_peak"]

VOCAB = 32000  # the llama preset's


class _TotalsOnly(MemTracker):
    """``MemTracker`` counting allocations only (module docstring)."""

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        pass

    def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
        pass

    def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass

    def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
        pass


def rank_tracker_peak(
    layers: int,
    seq: int,
    shape: Sequence[int],
    names: Sequence[str],
    config: FSDP2Config,
    *,
    pp_rank: int,
    hidden: tuple[int, ...],
) -> int:
    """Peak bytes of pipeline rank ``pp_rank`` over two steps of a schedule
    with several stages per rank; ``hidden``: one micro-batch's activation
    between stages (bf16, one sequence per micro-batch)."""
    assert names[0] == "pp", "the recipe reads the pipeline coordinate off dim 0"
    with torch.device("meta"):
        model = build_preset("llama", layers)
    rank = pp_rank * (math.prod(shape) // shape[0])
    with fake_mesh(shape, names, rank=rank) as mesh:
        stages = FSDP2Manager(config, mesh).parallelize(model, loss_fn=loss)
        assert not isinstance(stages, nn.Module) and len(stages.modules) > 1, "a rank with several stages"
        order = [a for a in stages.schedule.pipeline_order[pp_rank] if a is not None]
        m = stages.microbatches
        last = len(stages.pipeline.stages) - 1
        module_of = dict(zip(stages.indices, stages.modules))
        with FakeTensorMode(allow_non_fake_inputs=True), own_propagation_fake_mode():
            for module in stages.modules:
                module.to_empty(device="cpu")
            optimizer = torch.optim.AdamW([p for mod in stages.modules for p in mod.parameters()], lr=1e-4, foreach=True)
            tokens = list(torch.randint(0, VOCAB, (m, seq)).tensor_split(m))
            labels = list(torch.randint(0, VOCAB, (m, seq)).tensor_split(m))
            # torch's receive buffers: inputs of every stage but the first, output gradients of every stage but the last
            received = {s: [torch.empty(hidden, dtype=torch.bfloat16) for _ in range(m)] for s in stages.indices if s != 0}
            grads = {s: [torch.empty(hidden, dtype=torch.bfloat16) for _ in range(m)] for s in stages.indices if s != last}
            tracker = _TotalsOnly()
            tracker.track_external(*stages.modules, optimizer, tokens, labels, *received.values(), *grads.values())
            with tracker:
                for _ in range(2):
                    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
                    for action in order:
                        s, i = action.stage_index, action.microbatch_index
                        assert i is not None
                        module = module_of[s]
                        if action.computation_type.name == "FORWARD":
                            x = tokens[i] if s == 0 else received[s][i].requires_grad_(True)
                            out = module(x)
                            # torch's stage keeps the output until its backward; the last one's loss too
                            held[(s, i)] = (loss(out, labels[i]), out) if s == last else (out, out)
                            del out
                        else:
                            assert action.computation_type.name == "FULL_BACKWARD", action
                            module.set_is_last_backward(False)
                            module.set_reshard_after_backward(False)
                            module.set_requires_gradient_sync(False)
                            root, output = held.pop((s, i))  # torch keeps the output through the backward
                            if s == last:
                                root.backward()
                            else:
                                root.backward(grads[s][i])
                            del root, output
                    for torch_stage in stages.stages:
                        torch_stage.perform_reduce_grad(m)
                    optimizer.step()
                    optimizer.zero_grad()
                    for buffers in received.values():  # as the schedule's next step begins
                        for x in buffers:
                            x.grad = None
                peak = tracker.get_tracker_snapshot("peak")
    (dev,) = peak
    return int(peak[dev]["Total"])
