"""A traced step at other sizes of its sharded parts.

A trace (:mod:`fsdptx.cli._trace`) is one step at one FSDP shard count.
What a rank holds at each moment splits into parts no shard count changes
(gathered parameters, unsharded gradients, activations, TP buffers) and
parts that are one shard of something: the sharded parameters, gradients
and optimizer state, but also FSDP's reduce-scatter output, the
compute-dtype copy of a shard before its all-gather and the optimizer
step's per-shard temporaries, which the tracker files under activations
and temporaries. So two uses:

- :func:`rescale`: the same mesh with the sharded parameters, gradients
  and optimizer state sized differently (another optimizer, offload,
  exact padding), the other categories kept;
- :func:`at_shard_count`: another shard count, from traces of the same
  step at two shard counts: every category of every sample is a fixed part
  plus a part that goes as one over the shard count, and two traces give
  both. ``--fit`` uses it so that one pair of traces stands for every
  larger shard count. :class:`ShardSeries` is its fast path for the one
  figure ``--fit`` needs of every mesh, the rescaled peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._report import OPTIMIZER_STATES, ParamShard
from ._trace import Sample, Trace

__all__ = ["ShardSeries", "at_shard_count", "between", "rescale", "steady_bytes", "traced_steady"]


def steady_bytes(shards: Mapping[str, ParamShard], optimizer: str) -> tuple[int, int, int]:
    """Exact per-rank (params, grads, optimizer state) of rank 0's shards."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATES)}")
    params = sum(s.local_numel * s.dtype.itemsize for s in shards.values())
    grads = sum(s.local_numel * s.dtype.itemsize for s in shards.values() if s.requires_grad)
    states = OPTIMIZER_STATES[optimizer] * grads  # in each shard's storage dtype, as zeros_like makes them
    return params, grads, states


def traced_steady(trace: Trace) -> tuple[int, int, int]:
    """(sharded params, sharded grads once all are reduced, optimizer state)
    as traced: params and state as the step starts (the optimizer step's
    temporaries also count as optimizer state), gradients at their most
    before the optimizer step."""
    first = trace.samples[0].bytes if trace.samples else {}
    grads = max((s.bytes.get("sharded_grads", 0) for s in trace.samples if s.phase != "optimizer"), default=0)
    return first.get("sharded_params", 0), grads, first.get("optimizer_state", 0)


def rescale(
    trace: Trace, *, traced: tuple[int, int, int], target: tuple[int, int, int]
) -> tuple[int, int, dict[str, int]]:
    """Peak of ``trace`` when the sharded parts are ``target`` instead of ``traced``.

    Every sample is recomputed with sharded parameters and optimizer state
    scaled to the target totals and sharded gradients scaled in proportion
    (the fraction of gradients already reduced at that moment is kept).
    The other categories are kept as traced. Returns (peak, sample index,
    breakdown)."""
    keys = ("sharded_params", "sharded_grads", "optimizer_state")
    factors = {k: (t / s if s else 0.0) for k, s, t in zip(keys, traced, target)}
    best, best_i, best_bytes = -1, 0, {}
    for i, sample in enumerate(trace.samples):
        scaled = {k: int(round(v * factors[k])) if k in factors else v for k, v in sample.bytes.items()}
        total = sum(scaled.values())
        if total > best:
            best, best_i, best_bytes = total, i, scaled
    return best, best_i, best_bytes


def between(a: int, a_shards: int, b: int, b_shards: int, shards: int) -> int:
    """``f + g / shards`` through ``(a_shards, a)`` and ``(b_shards, b)``,
    in integers: ``a + (b - a) * (1/shards - 1/a_shards) / (1/b_shards - 1/a_shards)``,
    the fraction rounded half to even exactly (no float in between)."""
    num = (b - a) * b_shards * (a_shards - shards)
    den = shards * (a_shards - b_shards)
    if den < 0:
        num, den = -num, -den
    q, r = divmod(num, den)
    return max(0, a + q + int(2 * r > den or (2 * r == den and q % 2 == 1)))


def at_shard_count(a: Trace, a_shards: int, b: Trace, b_shards: int, shards: int) -> Trace:
    """The step of ``a`` and ``b`` (the same step traced at ``a_shards`` and
    ``b_shards`` FSDP ranks) at ``shards`` ranks.

    Sample by sample and category by category, bytes are ``f + g / n`` at
    ``n`` shards; the two traces give ``f`` and ``g``. Exact where no
    parameter's dim 0 pads at any of the three shard counts (FSDP pads a
    shard to the rounded-up share); otherwise off by that padding.
    Collectives and the activations are interpolated the same way.

    Raises:
        ValueError: the two traces are not the same step (their operators,
            units, phases or collectives differ), or the shard counts are
            not distinct positive ints.
    """
    _check_same_step(a, a_shards, b, b_shards, shards)

    def fit(x: int, y: int) -> int:
        return between(x, a_shards, y, b_shards, shards)

    samples = tuple(
        Sample(
            sb.index,
            sb.phase,
            sb.unit,
            {k: fit(sa.bytes.get(k, 0), sb.bytes.get(k, 0)) for k in dict.fromkeys([*sa.bytes, *sb.bytes])},
        )
        for sa, sb in zip(a.samples, b.samples)
    )
    collectives = tuple(
        dataclasses.replace(cb, bytes=fit(ca.bytes, cb.bytes)) for ca, cb in zip(a.collectives, b.collectives)
    )
    return dataclasses.replace(
        b, samples=samples, collectives=collectives, activations=fit(a.activations, b.activations)
    )


def _check_same_step(a: Trace, a_shards: int, b: Trace, b_shards: int, shards: int) -> None:
    if len({a_shards, b_shards}) != 2 or min(a_shards, b_shards, shards) < 1:
        raise ValueError(
            f"at_shard_count: needs two distinct shard counts and a positive target, got {a_shards}, "
            f"{b_shards} -> {shards}"
        )
    steps_a = [(s.phase, s.unit) for s in a.samples]
    steps_b = [(s.phase, s.unit) for s in b.samples]
    colls_a = [(c.op, c.source, c.phase, c.unit) for c in a.collectives]
    colls_b = [(c.op, c.source, c.phase, c.unit) for c in b.collectives]
    if steps_a != steps_b or colls_a != colls_b:
        raise ValueError(
            f"the steps traced at {a_shards} and {b_shards} FSDP shards differ ({len(steps_a)} and {len(steps_b)} "
            f"operators, {len(colls_a)} and {len(colls_b)} collectives), so neither stands for {shards} shards"
        )


_STEADY = ("sharded_params", "sharded_grads", "optimizer_state")


@dataclass(frozen=True, eq=False)
class ShardSeries:
    """One step traced at two FSDP shard counts, held as two matrices
    (samples x categories) so that its rescaled peak at any shard count
    costs a few tensor operations instead of a derived trace.

    ``--fit`` asks every mesh of a world for that peak (hundreds of them,
    each with thousands of samples per trace); building each mesh's trace
    with :func:`at_shard_count` and scanning it with :func:`rescale` was
    most of what the search spent outside the traces. The numbers are
    theirs, to the byte (a property test holds them equal): the same
    integer interpolation, the same rounding of the scaled categories.

    Build with :meth:`of`.
    """

    a_shards: int
    b_shards: int
    keys: tuple[str, ...]
    a: torch.Tensor  # int64, samples x keys
    b: torch.Tensor
    before_optimizer: torch.Tensor  # bool per sample: where the sharded gradients are at their most

    @classmethod
    def of(cls, a: Trace, a_shards: int, b: Trace, b_shards: int) -> ShardSeries:
        """The series of ``a`` and ``b``, the same step at ``a_shards`` and ``b_shards`` ranks.

        Raises:
            ValueError: as :func:`at_shard_count`: different steps, or equal shard counts.
        """
        _check_same_step(a, a_shards, b, b_shards, 1)
        keys = tuple(dict.fromkeys(k for t in (a, b) for s in t.samples for k in s.bytes))

        def matrix(t: Trace) -> torch.Tensor:
            flat = [s.bytes.get(k, 0) for s in t.samples for k in keys]
            return torch.tensor(flat, dtype=torch.int64).reshape(len(t.samples), len(keys))

        steps = torch.tensor([s.phase != "optimizer" for s in b.samples], dtype=torch.bool)
        return cls(a_shards, b_shards, keys, matrix(a), matrix(b), steps)

    def __reduce__(self) -> tuple[Any, ...]:
        # The matrices travel as numbers: torch would share the tensors
        # through file descriptors, which a worker of a pool cannot always
        # hand over, and rebuilding them from the traces costs more.
        rows = (self.a.shape[0], len(self.keys))
        return (
            _series_of_lists,
            (self.a_shards, self.b_shards, self.keys, rows, self.a.flatten().tolist(), self.b.flatten().tolist(), self.before_optimizer.tolist()),
        )

    def samples(self, shards: int) -> torch.Tensor:
        """Every sample's bytes per category at ``shards`` ranks, as
        :func:`at_shard_count` derives them."""
        if shards < 1:
            raise ValueError(f"ShardSeries: the shard count must be positive, got {shards}")
        num = (self.b - self.a) * (self.b_shards * (self.a_shards - shards))
        den = shards * (self.a_shards - self.b_shards)
        if den < 0:
            num, den = -num, -den
        q = torch.div(num, den, rounding_mode="floor")
        r2 = 2 * (num - q * den)
        q = q + ((r2 > den) | ((r2 == den) & (q % 2 == 1))).long()
        return (self.a + q).clamp(min=0)

    def peak(self, shards: int, target: tuple[int, int, int]) -> int:
        """``rescale(at_shard_count(...), traced=traced_steady(...), target=target)[0]``."""
        values = self.samples(shards)
        if values.shape[0] == 0:
            return -1  # rescale's value for a trace without samples
        column = {k: i for i, k in enumerate(self.keys)}

        def col(key: str) -> torch.Tensor | None:
            return values[:, column[key]] if key in column else None

        params, grads, states = (col(k) for k in _STEADY)
        traced = (
            0 if params is None else int(params[0]),
            0 if grads is None or not bool(self.before_optimizer.any()) else int(grads[self.before_optimizer].max()),
            0 if states is None else int(states[0]),
        )
        factors = [0.0 if not was else want / was for was, want in zip(traced, target)]
        scale = {column[k]: f for k, f in zip(_STEADY, factors) if k in column}
        products = values.double()
        for i, factor in scale.items():
            products[:, i] = products[:, i] * factor
        if products.numel() and float(products.abs().max()) * len(self.keys) >= _INT64_SAFE:
            # A row's total could pass int64: the plain path's Python
            # integers, row by row (sizes no real step reaches).
            return max(
                sum(int(round(v * scale[i])) if i in scale else v for i, v in enumerate(row))
                for row in values.tolist()
            )
        scaled = values.clone()
        for i in scale:
            scaled[:, i] = torch.round(products[:, i]).long()
        return int(scaled.sum(dim=1).max())


def _series_of_lists(
    a_shards: int, b_shards: int, keys: tuple[str, ...], rows: tuple[int, int], a: list[int], b: list[int], steps: list[bool]
) -> ShardSeries:
    """A :class:`ShardSeries` from what its ``__reduce__`` sent."""

    def matrix(flat: list[int]) -> torch.Tensor:
        return torch.tensor(flat, dtype=torch.int64).reshape(rows)

    return ShardSeries(a_shards, b_shards, keys, matrix(a), matrix(b), torch.tensor(steps, dtype=torch.bool))


_INT64_SAFE = float(2**62)
"""Below this, a scaled sample's categories and their sum stay in int64."""
