"""What one training step communicates and holds per rank (pure).

:func:`step_traffic` derives the FSDP collectives from a Plan alone;
:func:`memory_plan` adds each parameter's rank-0 shard (:class:`ParamShard`,
read off DTensors after apply or computed with :func:`local_shape`) and
returns a :class:`MemoryPlan`, whose docstring says what is counted.

FSDP2 issues, per unit with parameters: one all-gather before forward, one
more before backward if the unit was resharded after forward, and one
reduce-scatter after backward. Checked against ``fully_shard`` on a fake mesh
(tests/cli/test_report.py); what decides "resharded after forward":

- ``None`` (FSDP2's default) means ``True``, except for the FSDP root: the
  first unit to run forward (the model root, ``""``, which the default
  pipeline always plans) keeps its parameters, since backward would gather
  them again at once. An explicit ``True`` on the root is honoured.
- ``False``, and cross-block units (planned with ``False``): one all-gather.
- An int is a group size to reshard to: ``1`` is turned into ``False`` by
  FSDP2 (one all-gather); any other valid size reshards (two all-gathers).

A unit whose forward ignores its input (an fp32 holder such as attention
sinks) still gets its one reduce-scatter: when its post-backward hook does not
fire, FSDP2's root reduces it in the end-of-backward callback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core._names import join_names
from ..plan._plan import Plan
from ..plan._types import Unit, reshards_after_forward

__all__ = [
    "OPTIMIZER_STATES",
    "MemoryPlan",
    "ParamShard",
    "UnitMemory",
    "UnitTraffic",
    "local_shape",
    "memory_plan",
    "step_traffic",
]


@dataclass(frozen=True)
class UnitTraffic:
    all_gathers: int
    reduce_scatters: int
    all_gather_bytes: int
    reduce_scatter_bytes: int


def _traffic(unit: Unit) -> UnitTraffic:
    if unit.numel == 0:
        return UnitTraffic(0, 0, 0, 0)
    storage = unit.storage_dtype or torch.float32
    policy = unit.mp_policy
    gather_dtype = (policy.param_dtype if policy else None) or storage
    reduce_dtype = (policy.reduce_dtype if policy else None) or gather_dtype
    gathers = 2 if reshards_after_forward(unit) else 1
    return UnitTraffic(
        all_gathers=gathers,
        reduce_scatters=1,
        all_gather_bytes=gathers * unit.numel * gather_dtype.itemsize,
        reduce_scatter_bytes=unit.numel * reduce_dtype.itemsize,
    )


def step_traffic(plan: Plan) -> tuple[UnitTraffic, ...]:
    """Per unit, the FSDP collectives and unsharded bytes of one forward+backward."""
    return tuple(_traffic(u) for u in plan.units)


# --------------------------------------------------------------------------- memory plan

OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "sgd": 1, "none": 0}
"""State tensors per trainable parameter element, each in the parameter's
storage dtype (torch's AdamW and SGD create them with ``zeros_like`` of the
sharded parameter: fp32 for fp32 master weights, bf16 for bf16-stored
ones): AdamW keeps two (``exp_avg``, ``exp_avg_sq``), SGD with momentum one
(plain SGD keeps none: use ``"none"``)."""


@dataclass(frozen=True)
class ParamShard:
    """One parameter as rank 0 holds it after tensor parallelism and FSDP.

    ``local_numel`` includes FSDP's padding: FSDP2 pads dim 0 of every
    parameter to a multiple of the shard count and allocates the padded
    shard on every rank, so rank 0's shard (the largest) is what each rank
    pays. ``tp_sharded`` says whether TP split it (then ``tp`` ranks share
    ``numel``); a TP-replicated parameter is whole on every TP rank.
    """

    fqn: str
    numel: int
    local_numel: int
    dtype: torch.dtype
    tp_sharded: bool
    requires_grad: bool = True


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_shape(shape: Sequence[int], *, tp_dim: int | None, tp: int, shards: int) -> tuple[int, ...]:
    """Rank 0's shard of a parameter of global ``shape``: dim ``tp_dim`` split
    over ``tp`` ranks, then dim 0 over ``shards`` FSDP ranks, both with
    ``torch.chunk`` sizes (rank 0 gets the rounded-up share; FSDP pads the
    other ranks' shards to that size)."""
    out = list(shape)
    if not out:  # a scalar parameter: FSDP2 shards it as one element
        return ()
    if tp_dim is not None and tp > 1:
        out[tp_dim] = ceil_div(out[tp_dim], tp)
    if shards > 1:
        out[0] = ceil_div(out[0], shards)
    return tuple(out)


@dataclass(frozen=True)
class UnitMemory:
    """Per-rank figures of one FSDP unit, in bytes."""

    params: int  # sharded parameters, storage dtype, padding included
    ideal: int  # the same without padding: global bytes / (shards x TP split)
    gathered: int  # all-gather output: unsharded (TP-local) params in the compute dtype
    reduce_input: int  # reduce-scatter input: unsharded (TP-local) grads in the reduce dtype

    @property
    def padding(self) -> int:
        return self.params - self.ideal

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.ideal if self.ideal else 0.0


PAD_FLAG_RATIO = 0.25


@dataclass(frozen=True)
class MemoryPlan:
    """What one rank holds during a training step, in bytes.

    Counted: sharded parameters (storage dtype), their gradients (storage
    dtype, as FSDP2 keeps them), optimizer state (fp32, ``states`` tensors
    per trainable element), and the all-gathered (unsharded, TP-local)
    parameters resident at the worst point of forward and of backward.

    Peak forward = parameters + gradients + optimizer + gathered at the
    worst forward point. Gradients are counted in forward too: they stay
    allocated across micro-batches under gradient accumulation (and with
    ``zero_grad(set_to_none=False)``); with ``set_to_none=True`` the first
    micro-batch's forward needs ``gradients`` less.

    Gathered at the worst point: every unit that does not reshard after
    forward stays resident once gathered (the root, the last block,
    cross-block holders), counted in full as an upper bound; to that, the
    largest step: a resharding block, the resharding units nested in it
    and the blocks its prefetch chain gathers ahead (forward chain in
    forward, backward chain in backward; without explicit chains, FSDP2's
    implicit backward prefetch of one block). In backward the step also
    holds the reduce-scatter input of its largest unit (unsharded
    gradients in the reduce dtype, one unit at a time).

    Not counted: activations and checkpointed inputs, the unsharded
    gradients of the compute dtype beside the reduce buffer, communication
    buffers of TP and of the HSDP all-reduce, the CUDA caching allocator's
    fragmentation, and the CUDA context.
    """

    units: tuple[UnitMemory, ...]
    params: int  # all parameters per rank, also those no unit owns
    params_ideal: int  # the same without FSDP padding
    grads: int
    optimizer: int
    optimizer_name: str
    largest_unit: int | None  # index into units
    forward_gathered: int
    backward_gathered: int
    forward_at: str  # where forward peaks (a unit's first module)
    backward_at: str

    @property
    def padding(self) -> int:
        return self.params - self.params_ideal

    @property
    def steady(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak_forward(self) -> int:
        return self.steady + self.forward_gathered

    @property
    def peak_backward(self) -> int:
        return self.steady + self.backward_gathered

    @property
    def largest_gathered(self) -> int:
        return 0 if self.largest_unit is None else self.units[self.largest_unit].gathered


def _unit_memory(
    unit: Unit, shards: Mapping[str, ParamShard], dp_shard: int, tp: int, split: Mapping[str, int]
) -> UnitMemory:
    """One unit's bytes; ``dp_shard`` is the shard count of the unit's own
    mesh, ``split`` the ``ep`` size of parameters split by expert (the
    all-gather output is then this EP rank's experts, not all of them)."""
    params = ideal = gathered = reduce_input = 0
    policy = unit.mp_policy
    for fqn in unit.params:
        s = shards[fqn]
        compute = unit.compute_dtype or s.dtype
        reduce = (policy.reduce_dtype if policy else None) or compute
        unsharded = s.local_numel * dp_shard  # the all-gather output, padding included
        params += s.local_numel * s.dtype.itemsize
        ideal_numel = s.numel / (dp_shard * (tp if s.tp_sharded else 1) * split.get(fqn, 1))
        ideal += int(round(ideal_numel * s.dtype.itemsize))
        gathered += unsharded * compute.itemsize
        if s.requires_grad:
            reduce_input += unsharded * reduce.itemsize
    return UnitMemory(params=params, ideal=ideal, gathered=gathered, reduce_input=reduce_input)


def _inside(fqn: str, block: str) -> bool:
    return fqn == block or fqn.startswith(block + ".")


def memory_plan(
    plan: Plan,
    shards: Mapping[str, ParamShard],
    *,
    dp_shard: int,
    tp: int = 1,
    optimizer: str = "adamw",
    moe_shard: int | None = None,
    ep: int = 1,
) -> MemoryPlan:
    """The per-rank memory of one training step under ``plan`` (pure).

    ``shards`` has every parameter of the model (also those no unit owns:
    they count in full on every rank); ``dp_shard`` is the FSDP shard count
    (``cp`` folded in, ``dp_replicate`` not: replicas hold the same shard).
    Expert units on the MoE mesh shard ``moe_shard`` ways (default
    ``dp_shard``), and parameters the plan splits by expert are divided
    by ``ep`` first: a rank holds ``1 / (ep * moe_shard)`` of them.
    See :class:`MemoryPlan` for what is and is not counted.
    """
    from ..plan.transforms import block_units  # local: the transforms import the planner

    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    split = {f: ep for f in plan.expert_parallel.params} if plan.expert_parallel is not None else {}
    on_moe = [moe_shard if moe_shard is not None and u.mesh == "moe" else dp_shard for u in plan.units]
    units = tuple(_unit_memory(u, shards, n, tp, split) for u, n in zip(plan.units, on_moe))
    params = sum(s.local_numel * s.dtype.itemsize for s in shards.values())
    owned = plan.owned_params
    params_ideal = sum(
        int(
            round(
                s.numel
                * s.dtype.itemsize
                / ((on_moe[owned[s.fqn]] if s.fqn in owned else 1) * (tp if s.tp_sharded else 1) * split.get(s.fqn, 1))
            )
        )
        for s in shards.values()
    )
    grads = sum(s.local_numel * s.dtype.itemsize for s in shards.values() if s.requires_grad)
    optimizer_bytes = OPTIMIZER_STATES[optimizer] * grads  # in each shard's storage dtype, as zeros_like makes them

    resh = [reshards_after_forward(u) for u in plan.units]
    base = sum(m.gathered for m, r in zip(units, resh) if not r)
    blocks = block_units(plan)
    index = {u.modules[0]: i for i, u in blocks}
    grouped: set[int] = set(index.values())
    nested: dict[int, list[int]] = {}
    for b, bu in blocks:
        block = bu.modules[0]
        inner = [
            i
            for i, u in enumerate(plan.units)
            if i not in grouped and block and all(_inside(m, block) for m in u.modules)
        ]
        nested[b] = inner
        grouped.update(inner)
    explicit = {c.unit: c for c in plan.prefetch}
    order = [i for i, _ in blocks]

    def chain(pos: int, forward: bool) -> list[int]:
        b = order[pos]
        name = plan.units[b].modules[0]
        if plan.prefetch:
            c = explicit.get(name)
            names = () if c is None else (c.forward if forward else c.backward)
            return [index[n] for n in names if n in index]
        return [] if forward or pos == 0 else [order[pos - 1]]

    def resident(ids: list[int]) -> int:
        return sum(units[i].gathered for i in set(ids) if resh[i])

    fwd_steps: list[tuple[int, int]] = []
    bwd_steps: list[tuple[int, int]] = []
    for pos, b in enumerate(order):
        group = [b, *nested[b]]
        fwd_steps.append((resident(group + chain(pos, True)), b))
        rs = max(units[i].reduce_input for i in group)
        bwd_steps.append((resident(group + chain(pos, False)) + rs, b))
    for i in range(len(plan.units)):
        if i not in grouped:
            fwd_steps.append((resident([i]), i))
            bwd_steps.append((resident([i]) + units[i].reduce_input, i))
    fwd, fwd_i = max(fwd_steps, key=lambda s: s[0], default=(0, -1))
    bwd, bwd_i = max(bwd_steps, key=lambda s: s[0], default=(0, -1))

    def where(i: int) -> str:
        return "" if i < 0 else join_names(plan.units[i].modules)

    largest = max(range(len(units)), key=lambda i: units[i].gathered, default=None)
    return MemoryPlan(
        units=units,
        params=params,
        params_ideal=params_ideal,
        grads=grads,
        optimizer=optimizer_bytes,
        optimizer_name=optimizer,
        largest_unit=largest,
        forward_gathered=base + fwd,
        backward_gathered=base + bwd,
        forward_at=where(fwd_i),
        backward_at=where(bwd_i),
    )
