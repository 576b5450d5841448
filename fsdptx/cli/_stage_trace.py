"""One optimizer step of one pipeline stage, traced as torch's schedule runs it.

A pipeline stage does not hold one micro-batch at a time. What torch 2.13's
``PipelineStage`` and its single-stage schedules hold, and so what the trace
reproduces (``torch/distributed/pipelining/stage.py``, ``schedules.py``):

- every stage but the first receives its input into buffers allocated once
  per micro-batch of the step (``num_microbatches`` of them, kept for the
  job), and every stage but the last receives the gradient of its output
  into as many more; both exist before the step starts;
- the schedule runs the stage's forwards and backwards in its own order
  (:func:`stage_actions`): GPipe every forward, then every backward; 1F1B
  ``num_stages - stage`` forwards, then one backward and one forward in
  turn; a micro-batch's output and saved activations live from its forward
  to its backward, so the stage holds
  :func:`fsdptx.plan._stages.in_flight_microbatches` of them at most;
- each backward runs with FSDP's gradient sync, reshard after backward and
  last-backward flag off: the stage's parameters stay gathered from the
  first forward to the end of the step and its unsharded gradients
  accumulate (in the reduce dtype) over the micro-batches; one
  ``perform_reduce_grad`` after the last backward reduce-scatters them all
  and divides them by the micro-batch count;
- a received input's gradient stays on its buffer (``.grad``) until the next
  step begins.

The stage's module, parallelized on the fake mesh, runs all of that for
real under ``FakeTensorMode`` with the dry run's ``FSDPMemTracker``
subclass, then the TP-replica sync and the AdamW step of
:func:`fsdptx.cli._memory.trace_step`. The last stage's loss is the same
fp32 cross entropy. Nothing is sent: the trace stands in for one rank of
the stage, and P2P moves no bytes the stage would not hold anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from ..core._torch_internals import FakeTensorMode, fast_fake_mode_lookup, own_propagation_fake_mode
from ..plan._stages import in_flight_microbatches
from ._trace import Sample, Trace, _local, _logits, _StepTracker, _tp_replica_sync, unpacked_sequences

__all__ = ["TRACED_SCHEDULES", "ActivationMeta", "StageTrace", "stage_actions", "trace_stage"]

TRACED_SCHEDULES = ("1F1B", "GPipe")
"""Schedules whose step the dry run traces: one stage per rank, each rank
running its stage's forwards and backwards alone."""


@dataclass(frozen=True)
class ActivationMeta:
    """The shape and dtype of the tensor one stage hands the next, per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StageTrace:
    """One stage's traced step.

    Attributes:
        trace: the samples and collectives; ``trace.activations`` is the most
            held saved for backward at the end of any forward (the
            micro-batches then in flight), ``trace.batch_seq`` one
            micro-batch's shape.
        actions: the stage's forwards and backwards (:func:`stage_actions`).
        spans: each action's samples, as a range of sample positions.
        in_flight: micro-batches whose activations the stage holds at most
            (:func:`fsdptx.plan._stages.in_flight_microbatches`).
        activations_per_microbatch: saved for backward at the end of the
            first micro-batch's forward.
        received: what the stage receives per micro-batch (None: the first).
        sent: what it hands on per micro-batch (None: the last).
    """

    trace: Trace
    actions: tuple[tuple[str, int], ...]
    spans: tuple[tuple[int, int], ...]
    in_flight: int
    activations_per_microbatch: int
    received: ActivationMeta | None
    sent: ActivationMeta | None

    @property
    def microbatches(self) -> int:
        return sum(1 for kind, _ in self.actions if kind == "F")

    @property
    def p2p_buffer_bytes(self) -> int:
        """torch's receive buffers: the input of every micro-batch and the
        gradient of every micro-batch's output, allocated once and kept."""
        per = (self.received.nbytes if self.received else 0) + (self.sent.nbytes if self.sent else 0)
        return self.microbatches * per

    @property
    def input_grad_bytes(self) -> int:
        """The received inputs' gradients, held from their backward to the next step."""
        return self.microbatches * (self.received.nbytes if self.received else 0)

    def microbatch_at(self, position: int) -> int | None:
        """The micro-batch whose forward or backward ran at the sample at
        ``position``; None after the last backward."""
        for (_, i), (lo, hi) in zip(self.actions, self.spans):
            if lo <= position < hi:
                return i
        return None


def stage_actions(schedule: str, stage: int, num_stages: int, microbatches: int) -> tuple[tuple[str, int], ...]:
    """The forwards (``"F"``) and backwards (``"B"``) stage ``stage`` runs in
    one step, with their micro-batch, in the order torch's schedule runs
    them (``Schedule1F1B`` / ``ScheduleGPipe._step_microbatches``)."""
    if schedule not in TRACED_SCHEDULES:
        raise ValueError(f"stage_actions: schedule {schedule!r} is not one of {', '.join(TRACED_SCHEDULES)}")
    if not 0 <= stage < num_stages or microbatches < 1:
        raise ValueError(
            f"stage_actions: stage {stage} of {num_stages} with {microbatches} micro-batches is not a pipeline step"
        )
    m = microbatches
    if schedule == "GPipe":
        return tuple(("F", i) for i in range(m)) + tuple(("B", i) for i in range(m))
    warmup = min(m, num_stages - stage)
    out = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while True:
        out.append(("B", backward))
        backward += 1
        if forward == m:
            break
        out.append(("F", forward))
        forward += 1
    out += [("B", i) for i in range(backward, m)]
    return tuple(out)


def trace_stage(
    module: nn.Module,
    *,
    index: int,
    num_stages: int,
    schedule: str,
    microbatches: int,
    micro_batch: int,
    seq: int,
    vocab: int,
    received: ActivationMeta | None,
    units: Sequence[str],
    mesh: DeviceMesh,
) -> StageTrace:
    """Trace one step of stage ``index`` (its module parallelized on the
    meta device on ``mesh``, the current fake mesh) at ``micro_batch`` x
    ``seq`` tokens per micro-batch; ``received`` is what the previous stage
    hands on (its :attr:`StageTrace.sent`), None for the first stage.
    Mutates ``module`` (its tensors become fake).

    Raises:
        TypeError: the module is not an FSDP root, or the last stage's
            output is not logits.
        ValueError: a stage after the first without ``received``.
    """
    if not isinstance(module, FSDPModule):
        raise TypeError(f"trace_stage: stage {index}'s module was not sharded (a plan with units is needed)")
    first, last = index == 0, index == num_stages - 1
    if (received is None) != first:
        raise ValueError(f"trace_stage: stage {index} needs the activation it receives (only the first stage takes none)")
    actions = stage_actions(schedule, index, num_stages, microbatches)
    m = microbatches
    # Built outside fake mode: the stage object holds no tensors; its
    # perform_reduce_grad is what torch's schedules call after the last backward.
    torch_stage = PipelineStage(module, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        own_propagation_fake_mode(),
        fast_fake_mode_lookup(),
        unpacked_sequences(),
    ):
        module.to_empty(device="cpu")
        module.train()
        params = [p for p in module.parameters() if p.requires_grad]
        shards = [_local(p) for p in params]
        optimizer = torch.optim.AdamW(shards, lr=1e-4, foreach=True)
        for shard in shards:  # steady state, as trace_step
            optimizer.state[shard] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(shard),
                "exp_avg_sq": torch.zeros_like(shard),
            }
        held: list[torch.Tensor] = []
        if first:
            tokens = torch.randint(0, vocab, (m * micro_batch, seq))
            held.append(tokens)
            inputs = list(tokens.tensor_split(m))
        else:
            assert received is not None
            inputs = [torch.empty(received.shape, dtype=received.dtype) for _ in range(m)]
            held += inputs
        if last:
            labels = torch.randint(0, vocab, (m * micro_batch, seq))
            held.append(labels)
            targets = list(labels.tensor_split(m))
        tracker = _StepTracker(module, optimizer, units)
        tracker.track_inputs(tuple(held))
        sent: ActivationMeta | None = None
        grad_buffers: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []  # sample index range of each action
        per_microbatch = most = 0  # saved for backward after the first forward, and after any
        with tracker:
            cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for kind, i in actions:
                start = len(tracker.samples)
                if kind == "F":
                    tracker.reset_mod_stats()  # its per-module stats refuse a module's second forward
                    x = inputs[i] if first else inputs[i].requires_grad_(True)
                    out = module(x)
                    if isinstance(out, DTensor):  # torch's stage sends (and gets the gradient of) the local shard
                        out = out.to_local()
                    if last:
                        logits = _logits(out)
                        loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets[i].flatten())
                        cache[i] = (loss, logits)  # fwd_cache keeps the output until its backward
                        del logits, loss
                    else:
                        if sent is None:
                            sent = ActivationMeta(tuple(out.shape), out.dtype)
                            # torch allocates these when the schedule first runs, so a steady step holds
                            # them throughout; here they appear once the first forward gives their shape,
                            # before any backward (the step's start, never its peak, holds them less)
                            grad_buffers = [torch.empty(sent.shape, dtype=sent.dtype) for _ in range(m)]
                            tracker.track_inputs(tuple(grad_buffers))
                        cache[i] = (out, out)
                    del out
                    saved = tracker.sample().bytes.get("activations", 0)
                    per_microbatch = per_microbatch or saved
                    most = max(most, saved)
                else:
                    module.set_is_last_backward(False)
                    module.set_reshard_after_backward(False)
                    module.set_requires_gradient_sync(False)
                    # torch's backward_one_chunk pops the output from its cache and keeps it in
                    # a local until the backward returns: the output lives through it
                    root, output = cache.pop(i)
                    if last:
                        root.backward()
                    else:
                        torch.autograd.backward(root, grad_buffers[i])
                    del root, output
                spans.append((start, len(tracker.samples)))
            tracker.stage = "reduce_grad"
            torch_stage.perform_reduce_grad(m)
            tracker.sample()
            notes: tuple[str, ...] = ()
            if "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:
                tracker.stage = "tp_sync"
                notes = _tp_replica_sync(tracker, module, mesh)
            tracker.stage = "optimizer"
            for p, shard in zip(params, shards):
                shard.grad = None if p.grad is None else _local(p.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            module.zero_grad(set_to_none=True)
    samples = _reduction_buffers_as_temporaries(tuple(tracker.samples))
    return StageTrace(
        trace=Trace(samples, tuple(tracker.collectives), most, (micro_batch, seq), notes=notes),
        actions=actions,
        spans=tuple(spans),
        in_flight=in_flight_microbatches(schedule, index, num_stages, m),
        activations_per_microbatch=per_microbatch,
        received=received,
        sent=sent,
    )


def _reduction_buffers_as_temporaries(samples: tuple[Sample, ...]) -> tuple[Sample, ...]:
    """The tracker files what is allocated outside forward and backward as
    activations; in ``perform_reduce_grad`` that is FSDP's reduce-scatter
    copies, which it files as temporaries when they are made inside a
    backward (a step without pipelining). Re-file them so, keeping totals."""
    out = list(samples)
    held: int | None = None
    for k, s in enumerate(out):
        if s.phase != "reduce_grad":
            continue
        act = s.bytes.get("activations", 0)
        held = act if held is None else held
        extra = act - held
        if extra > 0:
            moved = {**s.bytes, "activations": held, "temporaries": s.bytes.get("temporaries", 0) + extra}
            out[k] = Sample(s.index, s.phase, s.unit, {c: v for c, v in moved.items() if v})
    return tuple(out)
