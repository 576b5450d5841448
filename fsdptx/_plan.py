"""The Plan: immutable, comparable, printable description of how to shard a model.

A Plan names modules and parameters by FQN only (never by object), so it can be
built without touching the model, compared in tests, printed for review, and
applied later by :func:`fsdptx.apply_plan`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["CrossBlockRequest", "DtypeRequest", "Plan", "Reduction", "Unit", "UnitKind", "REDUCTIONS"]

Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[Reduction, ...] = ("mean", "sum")
UnitKind = Literal["cross-block", "dtype", "block", "root"]


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: one call of the sharding primitive.

    ``modules`` has one FQN for an ordinary unit and several for a unit that
    spans modules (one ``fully_shard([...])`` call, one parameter group).
    ``params`` are the parameter FQNs the unit will own: exactly what the
    primitive claims given ``ignored_params`` and the units applied before it.
    """

    modules: tuple[str, ...]
    params: tuple[str, ...]
    ignored_params: tuple[str, ...]
    kind: UnitKind
    storage_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None
    mp_policy: MixedPrecisionPolicy | None
    offload_policy: OffloadPolicy | None
    reshard_after_forward: bool | int | None
    numel: int
    nbytes: int


@dataclass(frozen=True)
class DtypeRequest:
    """What :func:`fsdptx.shard_by_dtype` asked for, kept in the Plan so that a
    later transform that claims parameters (``shard_across_blocks``) can
    re-resolve the dtype units; this is what makes ``compose`` order-free."""

    targets: tuple[str, ...]
    fp32_compute_module_names: tuple[str, ...]
    ignored_params: tuple[str, ...]
    reshard_after_forward: bool | int | None
    # The model root ("") always gets a unit in a pipeline: FSDP2's root unit
    # drives lazy init and owns what no block owns. A single module sharded by
    # fully_shard_by_dtype is not the model root and gets one only if needed.
    always_shard_root: bool = True


@dataclass(frozen=True)
class CrossBlockRequest:
    """What :func:`fsdptx.shard_across_blocks` asked for: one unit per name
    in ``names``, spanning that submodule of every block in ``blocks``."""

    blocks: tuple[str, ...]
    names: tuple[str, ...]


class FrozenReductions(Mapping[str, Reduction]):
    """Parameter FQN -> reduction, immutable, in FQN order; unlike a
    ``MappingProxyType`` it pickles and deep-copies, so a Plan can be sent
    between processes or kept for later."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Reduction] | None = None) -> None:
        self._items: dict[str, Reduction] = dict(sorted((items or {}).items()))

    def __getitem__(self, key: str) -> Reduction:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return f"FrozenReductions({self._items!r})"

    def __reduce__(self) -> tuple[type[FrozenReductions], tuple[dict[str, Reduction]]]:
        return (FrozenReductions, (self._items,))


@dataclass(frozen=True)
class Plan:
    """Immutable result of planning; ``units`` are in application order
    (children before parents). ``reductions`` maps parameter FQN to its
    TP-replica gradient reduction; ``exclusions`` are module FQNs whose subtree
    stays rank-local. ``mp_policy``/``offload_policy``/``reshard_after_forward``
    are the defaults transforms start from (``None`` policy: mixed precision
    disabled)."""

    units: tuple[Unit, ...] = ()
    reductions: Mapping[str, Reduction] = field(default_factory=FrozenReductions)
    exclusions: tuple[str, ...] = ()
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    reshard_after_forward: bool | int | None = None
    dtype_request: DtypeRequest | None = None
    cross_block_requests: tuple[CrossBlockRequest, ...] = ()
    # Read-only index of the model being planned, shared by the transforms of
    # one fsdptx.plan() call so the model is walked once; plan() drops it
    # before returning. Not part of the Plan's value.
    scratch: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "exclusions", tuple(self.exclusions))
        if not isinstance(self.reductions, FrozenReductions):
            object.__setattr__(self, "reductions", FrozenReductions(self.reductions))

    def replace(self, **changes: object) -> Plan:
        """A copy with ``changes``; the Plan itself never changes."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def owned_params(self) -> dict[str, int]:
        """Parameter FQN -> index of the unit that owns it."""
        return {p: i for i, u in enumerate(self.units) for p in u.params}

    def __str__(self) -> str:
        return format_plan(self)


def _dtype_name(d: torch.dtype | None) -> str:
    return "-" if d is None else str(d).removeprefix("torch.")


def summarize_modules(modules: tuple[str, ...]) -> str:
    """``layers.0.attn.sinks`` .. ``layers.39.attn.sinks`` -> ``layers.*.attn.sinks (x40)``."""
    if len(modules) == 1:
        return modules[0] or "<root>"
    patterns = {re.sub(r"(?<![^.])\d+(?![^.])", "*", m) for m in modules}
    if len(patterns) == 1:
        return f"{patterns.pop()} (x{len(modules)})"
    return f"{modules[0]} +{len(modules) - 1} more"


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_plan(plan: Plan) -> str:
    """Render the plan as a fixed-width table, one row per unit in order."""
    header = ("#", "kind", "modules", "storage->compute", "params", "numel", "bytes", "reshard")
    rows = [header]
    for i, u in enumerate(plan.units):
        rows.append(
            (
                str(i),
                u.kind,
                summarize_modules(u.modules),
                "-" if u.storage_dtype is None else f"{_dtype_name(u.storage_dtype)}->{_dtype_name(u.compute_dtype)}",
                str(len(u.params)),
                f"{u.numel:,}",
                _human_bytes(u.nbytes),
                "default" if u.reshard_after_forward is None else str(u.reshard_after_forward),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(u.nbytes for u in plan.units)
    lines.append(f"{len(plan.units)} units, {_human_bytes(total)} of parameters")
    if plan.reductions:
        counts = {r: sum(1 for v in plan.reductions.values() if v == r) for r in REDUCTIONS}
        lines.append(
            "tp-replica reductions: "
            + ", ".join(f"{n} {r}" for r, n in counts.items() if n)
            + " (unmarked replicated params: mean)"
        )
    if plan.exclusions:
        lines.append("excluded from tp-replica sync: " + ", ".join(plan.exclusions))
    return "\n".join(lines)
