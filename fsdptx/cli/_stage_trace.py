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
:func:`fsdptx.cli._memory.trace_step`. A rank of ``Interleaved1F1B`` runs
several stages, each an FSDP root of its own: :func:`trace_rank` runs them
all in the order torch's schedule gives the rank
(:func:`fsdptx.plan._stages.interleaved_1f1b_actions`) under one tracker
instrumenting every root, one ``perform_reduce_grad`` per stage and one
AdamW step over all their parameters. The last stage's loss is the same
fp32 cross entropy. Nothing is sent: the trace stands in for one rank of
the stage, and P2P moves no bytes the stage would not hold anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from ..core._torch_internals import FakeTensorMode, fast_fake_mode_lookup, own_propagation_fake_mode
from ..plan._stages import in_flight_microbatches, interleaved_1f1b_actions
from ._trace import Sample, Trace, _local, _logits, _StepTracker, _tp_replica_sync, unpacked_sequences

__all__ = ["TRACED_SCHEDULES", "ActivationMeta", "RankTrace", "StageTrace", "stage_actions", "trace_rank", "trace_stage"]

TRACED_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
"""Schedules whose step the dry run traces: one stage per rank
(:func:`trace_stage`), or several in torch's interleaved order (:func:`trace_rank`)."""

_ONE_STAGE_PER_RANK = ("1F1B", "GPipe")


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
    if schedule not in _ONE_STAGE_PER_RANK:
        raise ValueError(f"stage_actions: schedule {schedule!r} is not one of {', '.join(_ONE_STAGE_PER_RANK)}")
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
    if (received is None) != (index == 0):
        raise ValueError(f"trace_stage: stage {index} needs the activation it receives (only the first stage takes none)")
    actions = stage_actions(schedule, index, num_stages, microbatches)
    run = _run_actions(
        {index: module},
        tuple((kind, index, i) for kind, i in actions),
        num_stages=num_stages,
        microbatches=microbatches,
        micro_batch=micro_batch,
        seq=seq,
        vocab=vocab,
        received={} if received is None else {index: received},
        units=units,
        mesh=mesh,
    )
    return StageTrace(
        trace=run.trace,
        actions=actions,
        spans=run.spans,
        in_flight=in_flight_microbatches(schedule, index, num_stages, microbatches),
        activations_per_microbatch=run.per_microbatch,
        received=received,
        sent=run.sent[index],
    )


@dataclass(frozen=True)
class RankTrace:
    """One pipeline rank's traced step when it runs several stages
    (``Interleaved1F1B``): all of them, in the schedule's order, under one tracker.

    Attributes:
        rank: the pipeline rank.
        trace: the samples and collectives of the rank; ``trace.activations``
            is the most held saved for backward at the end of any forward.
        actions: ``(kind, stage, micro-batch)`` as the rank runs them
            (:func:`fsdptx.plan._stages.interleaved_1f1b_actions`).
        spans: each action's samples, as a range of sample positions.
        in_flight: the most micro-batches (over its stages) whose
            activations the rank holds at once.
        activations_per_microbatch: saved for backward at the end of the
            rank's first forward.
        received: per stage, what it receives per micro-batch (None: the first stage).
        sent: per stage, what it hands on per micro-batch (None: the last stage).
    """

    rank: int
    trace: Trace
    actions: tuple[tuple[str, int, int], ...]
    spans: tuple[tuple[int, int], ...]
    in_flight: int
    activations_per_microbatch: int
    received: Mapping[int, ActivationMeta | None]
    sent: Mapping[int, ActivationMeta | None]

    @property
    def microbatches(self) -> int:
        return sum(1 for kind, _, _ in self.actions if kind == "F") // len(self.received)

    @property
    def p2p_buffer_bytes(self) -> int:
        """torch's receive buffers of every stage of the rank (:attr:`StageTrace.p2p_buffer_bytes`)."""
        return self.microbatches * sum(
            (r.nbytes if r else 0) + (s.nbytes if s else 0) for r, s in zip(self.received.values(), self.sent.values())
        )

    @property
    def input_grad_bytes(self) -> int:
        """The received inputs' gradients of every stage, held from their backward to the next step."""
        return self.microbatches * sum(r.nbytes for r in self.received.values() if r)

    def action_at(self, position: int) -> tuple[str, int, int] | None:
        """The forward or backward (kind, stage, micro-batch) that ran at the
        sample at ``position``; None outside them."""
        for action, (lo, hi) in zip(self.actions, self.spans):
            if lo <= position < hi:
                return action
        return None


def trace_rank(
    modules: Mapping[int, nn.Module],
    *,
    rank: int,
    num_stages: int,
    stages_per_rank: int,
    microbatches: int,
    micro_batch: int,
    seq: int,
    vocab: int,
    received: Mapping[int, ActivationMeta],
    units: Sequence[str],
    mesh: DeviceMesh,
) -> RankTrace:
    """Trace one step of pipeline rank ``rank`` of an ``Interleaved1F1B``
    pipeline: ``modules`` are its stages by index (each parallelized on the
    meta device on ``mesh``, the current fake mesh), run in torch's order
    for the rank with one tracker over all of them.

    ``received`` gives what each stage after the first receives, where the
    caller knows it (traced on an earlier rank). A stage missing there
    receives what the rank's own first stage hands on (rank 0's later
    stages, whose senders are traced after it); the returned
    :attr:`RankTrace.received` says what was used, for the caller to check
    against the sender's trace. Mutates the modules (their tensors become fake).

    Raises:
        TypeError: a module is not an FSDP root, or the last stage's output is not logits.
    """
    pp = num_stages // stages_per_rank
    actions = interleaved_1f1b_actions(rank, pp, stages_per_rank, microbatches)
    run = _run_actions(
        modules,
        actions,
        num_stages=num_stages,
        microbatches=microbatches,
        micro_batch=micro_batch,
        seq=seq,
        vocab=vocab,
        received=received,
        units=units,
        mesh=mesh,
    )
    held = most = 0
    for kind, _, _ in actions:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return RankTrace(
        rank=rank,
        trace=run.trace,
        actions=actions,
        spans=run.spans,
        in_flight=most,
        activations_per_microbatch=run.per_microbatch,
        received={s: run.received.get(s) for s in sorted(modules)},
        sent={s: run.sent[s] for s in sorted(modules)},
    )


@dataclass(frozen=True)
class _Run:
    trace: Trace
    spans: tuple[tuple[int, int], ...]
    per_microbatch: int
    received: dict[int, ActivationMeta]
    sent: dict[int, ActivationMeta | None]


def _run_actions(
    modules: Mapping[int, nn.Module],
    actions: Sequence[tuple[str, int, int]],
    *,
    num_stages: int,
    microbatches: int,
    micro_batch: int,
    seq: int,
    vocab: int,
    received: Mapping[int, ActivationMeta],
    units: Sequence[str],
    mesh: DeviceMesh,
) -> _Run:
    """The traced step of one rank's stages (``modules`` by index) running
    ``actions`` (``(kind, stage, micro-batch)``), as the module docstring says."""
    fsdp: dict[int, FSDPModule] = {}
    for index, module in modules.items():
        if not isinstance(module, FSDPModule):
            raise TypeError(f"trace_stage: stage {index}'s module was not sharded (a plan with units is needed)")
        fsdp[index] = module
    last = num_stages - 1
    m = microbatches
    # Built outside fake mode: the stage objects hold no tensors; their
    # perform_reduce_grad is what torch's schedules call after the last backward.
    group = mesh["pp"].get_group()
    torch_stages = {s: PipelineStage(mod, s, num_stages, torch.device("cpu"), group=group) for s, mod in modules.items()}
    roots = list(modules.values())
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        own_propagation_fake_mode(),
        fast_fake_mode_lookup(),
        unpacked_sequences(),
    ):
        for module in roots:
            module.to_empty(device="cpu")
            module.train()
        params = [p for module in roots for p in module.parameters() if p.requires_grad]
        shards = [_local(p) for p in params]
        optimizer = torch.optim.AdamW(shards, lr=1e-4, foreach=True)
        for shard in shards:  # steady state, as trace_step
            optimizer.state[shard] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(shard),
                "exp_avg_sq": torch.zeros_like(shard),
            }
        held: list[torch.Tensor] = []
        tokens: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        inputs: dict[int, list[torch.Tensor]] = {}
        got = dict(received)
        if 0 in modules:
            whole = torch.randint(0, vocab, (m * micro_batch, seq))
            held.append(whole)
            tokens = list(whole.tensor_split(m))
        for s, meta in got.items():
            inputs[s] = [torch.empty(meta.shape, dtype=meta.dtype) for _ in range(m)]
            held += inputs[s]
        if last in modules:
            labels = torch.randint(0, vocab, (m * micro_batch, seq))
            held.append(labels)
            targets = list(labels.tensor_split(m))
        tracker = _StepTracker(roots[0], optimizer, units, more=roots[1:])
        tracker.track_inputs(tuple(held))
        sent: dict[int, ActivationMeta | None] = {s: None for s in modules}
        first_sent: ActivationMeta | None = None
        grad_buffers: dict[int, list[torch.Tensor]] = {}
        spans: list[tuple[int, int]] = []  # sample index range of each action
        per_microbatch = most = 0  # saved for backward after the first forward, and after any
        with tracker:
            cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
            for kind, s, i in actions:
                start = len(tracker.samples)
                module = modules[s]
                if kind == "F":
                    # its per-module stats refuse a module's second forward; the other stages'
                    # stay, which their backwards (FSDP's pre-backward hook) look up
                    for sub in module.modules():
                        tracker.memory_tracking.pop(sub, None)
                    if s != 0 and s not in inputs:
                        # a sender traced later: it hands on what this rank's first stage does,
                        # allocated (as the gradient buffers below) once that shape is known
                        if first_sent is None:
                            raise RuntimeError(f"stage {s} runs before any stage of its rank hands on an activation")
                        got[s] = first_sent
                        inputs[s] = [torch.empty(first_sent.shape, dtype=first_sent.dtype) for _ in range(m)]
                        tracker.track_inputs(tuple(inputs[s]))
                    x = tokens[i] if s == 0 else inputs[s][i].requires_grad_(True)
                    out = module(x)
                    if isinstance(out, DTensor):  # torch's stage sends (and gets the gradient of) the local shard
                        out = out.to_local()
                    if s == last:
                        logits = _logits(out)
                        loss = nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets[i].flatten())
                        cache[(s, i)] = (loss, logits)  # fwd_cache keeps the output until its backward
                        del logits, loss
                    else:
                        if sent[s] is None:
                            meta = ActivationMeta(tuple(out.shape), out.dtype)
                            sent[s] = meta
                            first_sent = first_sent or meta
                            # torch allocates these when the schedule first runs, so a steady step holds
                            # them throughout; here they appear once the first forward gives their shape,
                            # before any backward (the step's start, never its peak, holds them less)
                            grad_buffers[s] = [torch.empty(meta.shape, dtype=meta.dtype) for _ in range(m)]
                            tracker.track_inputs(tuple(grad_buffers[s]))
                        cache[(s, i)] = (out, out)
                    del out
                    saved = tracker.sample().bytes.get("activations", 0)
                    per_microbatch = per_microbatch or saved
                    most = max(most, saved)
                else:
                    fsdp[s].set_is_last_backward(False)
                    fsdp[s].set_reshard_after_backward(False)
                    fsdp[s].set_requires_gradient_sync(False)
                    # torch's backward_one_chunk pops the output from its cache and keeps it in
                    # a local until the backward returns: the output lives through it
                    root, output = cache.pop((s, i))
                    if s == last:
                        root.backward()
                    else:
                        torch.autograd.backward(root, grad_buffers[s][i])
                    del root, output
                spans.append((start, len(tracker.samples)))
            tracker.stage = "reduce_grad"
            for torch_stage in torch_stages.values():
                torch_stage.perform_reduce_grad(m)
            tracker.sample()
            notes: tuple[str, ...] = ()
            if "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:
                tracker.stage = "tp_sync"
                notes = _tp_replica_sync(tracker, nn.ModuleList(roots), mesh)
            tracker.stage = "optimizer"
            for p, shard in zip(params, shards):
                shard.grad = None if p.grad is None else _local(p.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for module in roots:
                module.zero_grad(set_to_none=True)
    samples = _reduction_buffers_as_temporaries(tuple(tracker.samples))
    trace = Trace(samples, tuple(tracker.collectives), most, (micro_batch, seq), notes=notes)
    return _Run(trace, tuple(spans), per_microbatch, got, sent)


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
