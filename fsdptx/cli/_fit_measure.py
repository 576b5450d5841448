"""The traced steps ``plan --fit`` derives its candidates from: one
(``tp``, ``cp``, checkpointing, replicated or not) setting traced at a few
FSDP shard counts and block counts, and what any other shard count's step
is from them (:mod:`fsdptx.cli._scaling`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..plan._plan import Plan
from ._memory import disable_kv_cache
from ._report import ParamShard
from ._scaling import ShardSeries, between, at_shard_count, rescale, traced_steady
from ._trace import Trace

__all__ = [
    "REFERENCE_SHARDS",
    "Measured",
    "Traced",
    "extrapolate",
    "measure",
    "ring_bytes",
    "shard_points",
    "shards_for",
    "trace_at",
    "trace_mesh",
    "trace_moe",
]

REFERENCE_SHARDS = (2, 4)
"""FSDP shard counts traced to stand for every larger one: each sample of a
step is a fixed part plus a part that goes as one over the shard count
(:func:`fsdptx.cli._scaling.at_shard_count`), and these two traces give
both. Smaller shard counts are traced themselves (one shard takes FSDP2's
copy path instead of collectives, so it is a step of its own)."""


def shard_points(needed: Iterable[int]) -> tuple[int, ...]:
    """The shard counts to trace for candidates at ``needed`` shard counts:
    each one up to ``REFERENCE_SHARDS[-1]`` itself, and the reference pair
    for any larger one."""
    needed = set(needed)
    points = {s for s in needed if s <= REFERENCE_SHARDS[-1]}
    if any(s > REFERENCE_SHARDS[-1] for s in needed):
        points.update(REFERENCE_SHARDS)
    return tuple(sorted(points))


@dataclass(frozen=True, eq=False)
class Traced:
    """One setting's step traced at one block count: its traces by FSDP
    shard count, the traced model's exact shards at every shard count the
    candidates ask for, and the reference pair as a :class:`ShardSeries`
    when larger shard counts derive from it. Plain data (no model, no
    closures), so a trace process can send it back."""

    layers: int
    points: Mapping[int, Trace]
    shards: Mapping[tuple[int, int], dict[str, ParamShard]]  # by (FSDP shard count, ep)
    series: ShardSeries | None

    @classmethod
    def of(
        cls, layers: int, points: Mapping[int, Trace], shards: Mapping[tuple[int, int], dict[str, ParamShard]]
    ) -> Traced:
        """The entry, with the reference pair's series when both are traced and are the same step."""
        series = None
        a, b = REFERENCE_SHARDS
        if a in points and b in points:
            with contextlib.suppress(ValueError):  # different steps: trace_at says so for the meshes that need them
                series = ShardSeries.of(points[a], a, points[b], b)
        return cls(layers, points, shards, series)

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent back from a trace process as plain data, the series with it
        # (ShardSeries pickles its matrices as numbers).
        return (Traced, (self.layers, dict(self.points), dict(self.shards), self.series))

    def trace(self, shards: int) -> Trace:
        """The whole step at ``shards`` FSDP ranks (:func:`trace_at`)."""
        return trace_at(self.points, shards)

    def peak(self, shards: int, target: tuple[int, int, int]) -> int:
        """The step's peak at ``shards`` ranks with its sharded parts sized
        ``target``: :func:`~fsdptx.cli._scaling.rescale` of :meth:`trace`,
        by the series' fast path where the trace would be derived."""
        if shards in self.points or self.series is None:
            trace = self.trace(shards)
            return rescale(trace, traced=traced_steady(trace), target=target)[0]
        return self.series.peak(shards, target)

    def activations(self, shards: int) -> int:
        return self._scalar(shards, lambda t: t.activations)

    def collective_bytes(self, shards: int, source: str) -> int:
        """Bytes of the step's collectives from ``source`` (``tp``, ...), each derived as :func:`at_shard_count` does."""
        if shards in self.points:
            return sum(c.bytes for c in self.points[shards].collectives if c.source == source)
        (a, ta), (b, tb) = ((n, self.points[n]) for n in REFERENCE_SHARDS)
        return sum(
            between(ca.bytes, a, cb.bytes, b, shards)
            for ca, cb in zip(ta.collectives, tb.collectives)
            if cb.source == source
        )

    def ring(self, shards: int) -> Any:
        """Ring attention's modelled buffers (``None`` without ``cp``): the same at every shard count."""
        return (self.points[shards] if shards in self.points else self.points[REFERENCE_SHARDS[-1]]).ring

    def _scalar(self, shards: int, get: Callable[[Trace], int]) -> int:
        if shards in self.points:
            return get(self.points[shards])
        a, b = REFERENCE_SHARDS
        return between(get(self.points[a]), a, get(self.points[b]), b, shards)


@dataclass(frozen=True)
class Measured:
    """The traces of one (tp, checkpointing, replicated or not) setting,
    one :class:`Traced` per traced block count."""

    traces: tuple[Traced, ...]


def trace_at(points: Mapping[int, Trace], shards: int) -> Trace:
    """The step at ``shards`` FSDP ranks: traced, or from the reference pair."""
    if shards in points:
        return points[shards]
    a, b = REFERENCE_SHARDS
    return at_shard_count(points[a], a, points[b], b, shards)


def ring_bytes(nbytes: float, n: int, factor: int = 1) -> int:
    return int(factor * nbytes * (n - 1) / n) if n > 1 else 0


def extrapolate(values: Sequence[tuple[int, float]], layers: int) -> int:
    if len(values) == 1:
        return int(values[0][1])
    (la, a), (lb, b) = values
    return int(round(b + (layers - lb) * (b - a) / (lb - la)))


def shards_for(model: nn.Module, plan: Plan, dims: Any, ep: int = 1) -> Callable[[int], dict[str, ParamShard]]:
    """Rank 0's shards of ``model`` (TP applied) for any FSDP shard count.

    With ``ep`` > 1 the experts (the plan's units on the MoE mesh) are
    split across ``ep`` and FSDP-sharded over the rest of the shard and TP
    ranks, as :attr:`Candidate.moe_mesh` lays them out."""
    from ..plan.transforms import expert_parallel
    from ._common import param_shards

    split = expert_parallel(model, plan) if ep > 1 else plan
    if split.expert_parallel is not None:
        uneven = [f"{m} ({n} experts)" for m, n in zip(split.expert_parallel.modules, split.expert_parallel.num_experts) if n % ep]
        if uneven:
            raise ValueError(f"--ep {ep} does not divide the expert count of {', '.join(uneven[:3])}")

    def at(dp_shard: int) -> dict[str, ParamShard]:
        moe = (dp_shard * dims.tp // ep, ep) if ep > 1 else None
        return param_shards(model, split, dataclasses.replace(dims, dp_shard=dp_shard), fsdp_applied=False, moe=moe)

    return at


def trace_mesh(tp: int, shards: int, replicated: bool, cp: int = 1) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The fake mesh a reference step is traced on: ``shards`` FSDP ranks,
    ``cp`` and ``tp`` ranks, and a replicate dim of 2 for HSDP meshes (what
    HSDP adds, its all-reduce and the buffers it holds, does not depend on
    how many replicas there are)."""
    dims = [("dp_replicate", 2)] if replicated else []
    dims += [("dp_shard", shards)] + ([("cp", cp)] if cp > 1 else []) + ([("tp", tp)] if tp > 1 else [])
    return tuple(size for _, size in dims), tuple(name for name, _ in dims)


def trace_moe(
    tp: int, shards: int, replicated: bool, ep: int
) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """Under ``--ep``, the experts as units of their own on a MoE mesh of
    the same ranks without ``ep`` (whole experts, split by ``ep`` from shapes)."""
    if ep == 1:
        return None
    if replicated:
        return (2, shards * tp), ("dp_replicate", "ep_shard")
    return (shards * tp,), ("ep_shard",)


def measure(
    build: Callable[[int | None], nn.Module],
    counts: Sequence[int | None],
    tp: int,
    points: Sequence[int],
    replicated: bool,
    setting: Any,
    ac: str | bool,
    batch_seq: tuple[int, int],
    ep: int,
    cp: int = 1,
    needed: Iterable[tuple[int, int]] = (),
) -> Measured:
    """Trace the step of one setting at every block count and shard count,
    with the traced model's shards at each (shard count, ep) in ``needed``
    (any ep > 1 traces alike: the experts whole, on a MoE mesh of their own).
    Every block count of one shard count is traced in one fake world, so
    the later traces reuse DTensor's sharding decisions of the first."""
    from ._run import dry_run_on, fake_world

    needed = sorted(set(needed))
    by_count: dict[int | None, dict[int, Trace]] = {n: {} for n in counts}
    last: dict[int | None, tuple[nn.Module, Plan, Any]] = {}
    for shards in points:
        with fake_world(*trace_mesh(tp, shards, replicated, cp), trace_moe(tp, shards, replicated, ep)) as (mesh, moe_mesh):
            for n in counts:
                model = build(n)
                if ac:
                    disable_kv_cache(model)  # as the dry run and a training run with checkpointing do
                run = dry_run_on(model, mesh, moe_mesh, setting, batch_seq=batch_seq)
                if run.trace is None:  # dry_run traces whenever batch_seq is given
                    raise RuntimeError(f"no trace for tp={tp}, activation_checkpointing={ac!r}")
                by_count[n][shards] = run.trace
                last[n] = model, run.plan, run.dims  # the same plan at every shard count
    traced = []
    for n in counts:
        model, plan, dims = last[n]  # points is never empty: every group has a mesh
        at = {e: shards_for(model, plan, dims, e) for e in {e for _, e in needed}}
        traced.append(Traced.of(n or 0, by_count[n], {(s, e): at[e](s) for s, e in needed}))
    return Measured(tuple(traced))
