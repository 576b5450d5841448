"""What changed between two plans, written like a review comment.

A plan of a 40-block model changes in 40 places at once when one setting
changes; listing each would bury the change. Lines that say the same thing
about FQNs differing only in their block indices are collapsed into one,
``layers.{0..39}.attn: checkpoint full -> selective``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core._names import collapse_keyed, join_names
from ._plan import Plan
from ._types import Unit

__all__ = ["PlanDiff", "diff_plans"]

_NONE = "(none)"


@dataclass(frozen=True)
class PlanDiff:
    """The differences between two plans, one readable line each.

    Falsy and empty (``str`` is ``""``) exactly when the plans are equal;
    ``str`` joins the lines for a review comment or a test failure.

    Attributes:
        lines: one line per change, block indices collapsed.

    Example::

        d = fsdptx.diff_plans(before, after)
        assert not d or str(d).splitlines() == list(d.lines)
    """

    lines: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.lines)

    def __len__(self) -> int:
        return len(self.lines)

    def __str__(self) -> str:
        return "\n".join(self.lines)


def collapse(items: Iterable[tuple[str, str]]) -> list[str]:
    """``(fqn, what changed)`` pairs as lines, one per change and FQN
    pattern: FQNs that differ only in index segments and say the same
    thing share one line (:func:`~fsdptx.core._names.collapse_keyed`).
    Order: first appearance."""
    return [f"{label}: {text}" if text else label for label, text, _names in collapse_keyed(items)]


def _short(value: Any) -> str:
    """A value as a diff shows it: dtypes without ``torch.``, policies by
    their fields, ``None`` as ``(none)``."""
    if value is None:
        return _NONE
    if isinstance(value, tuple):
        return "(" + ", ".join(_short(v) for v in value) + ")" if value else "()"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_short(getattr(value, f.name))}" for f in dataclasses.fields(value) if f.compare)
        return f"{type(value).__name__}({fields})"
    return str(value).removeprefix("torch.")


def _changed(a: Any, b: Any) -> str:
    return f"{_short(a)} -> {_short(b)}"


def _per_key(a: Mapping[str, Any], b: Mapping[str, Any], label: str = "") -> list[tuple[str, str]]:
    """One ``(key, "old -> new")`` per key whose value differs, absent as ``(none)``."""
    out = []
    for key in sorted(set(a) | set(b)):
        old, new = a.get(key), b.get(key)
        if old != new:
            out.append((key, f"{label}{_short(old)} -> {_short(new)}"))
    return out


def _relative(module: str, params: list[str]) -> str:
    """Parameter names as a diff shows them under their unit: relative to
    the unit's module when they all lie under it (so that the same change
    in every block reads the same and collapses), else in full."""
    prefix = module + "." if module else ""
    if len(params) and all(p.startswith(prefix) for p in params):
        params = [p[len(prefix):] for p in params]
    return join_names(params)


def _units(a: tuple[Unit, ...], b: tuple[Unit, ...]) -> list[str]:
    """Units are matched by their modules: a unit of the same modules that
    gains or loses parameters or settings is the same unit changed. Each
    line is named by the unit's module, so the same change in every block
    collapses into one line."""
    items: list[tuple[str, str]] = []
    old = {u.modules: u for u in a}
    new = {u.modules: u for u in b}
    for modules, gone in old.items():
        if modules not in new:
            items.append((join_names(modules), f"{gone.kind} unit removed"))
    for modules, v in new.items():
        name = join_names(modules)
        u = old.get(modules)
        if u is None:
            items.append((name, f"new {v.kind} unit of {len(v.params)} params"))
            continue
        gained = [p for p in v.params if p not in set(u.params)]
        lost = [p for p in u.params if p not in set(v.params)]
        if gained:
            items.append((name, "unit gains " + _relative(modules[0], gained)))
        if lost:
            items.append((name, "unit loses " + _relative(modules[0], lost)))
        for f in dataclasses.fields(Unit):
            # numel and nbytes follow from the parameters when those changed
            if f.name in ("modules", "params") or not f.compare or (f.name in ("numel", "nbytes") and (gained or lost)):
                continue
            x, y = getattr(u, f.name), getattr(v, f.name)
            if x != y:
                items.append((name, f"unit {f.name} {_changed(x, y)}"))
    lines = collapse(items)
    kept = [m for m in new if m in old]
    if [m for m in old if m in new] != kept:
        lines.append("unit order changes: " + ", ".join(join_names(m) for m in kept))
    return lines


def _checkpointing(a: Plan, b: Plan) -> list[str]:
    def modes(p: Plan) -> dict[str, str]:
        ac = p.checkpointing
        return {} if ac is None else {m: f"{ac.mode}" for m in ac.modules}

    return collapse(_per_key(modes(a), modes(b), "checkpoint "))


def _tensor_parallel(a: Plan, b: Plan) -> list[str]:
    x, y = a.tensor_parallel, b.tensor_parallel
    styles = [({} if t is None else {s.module: s.style for s in t.assignments}) for t in (x, y)]
    lines = collapse(_per_key(styles[0], styles[1]))
    patterns = [({} if t is None else {s.module: s.pattern for s in t.assignments}) for t in (x, y)]
    lines += collapse(
        (m, f"TP pattern {_short(patterns[0][m])} -> {_short(patterns[1][m])}")
        for m in sorted(set(patterns[0]) & set(patterns[1]))
        if patterns[0][m] != patterns[1][m]
    )
    if x is None or y is None:
        if x != y:
            lines.append(f"tensor parallelism: {'requested' if x is None else 'dropped'}")
        return lines
    for f in dataclasses.fields(x):
        if f.name != "assignments" and f.compare:
            lines += _field_lines(f"tensor_parallel.{f.name}", getattr(x, f.name), getattr(y, f.name))
    return lines


def _prefetch(a: Plan, b: Plan) -> list[str]:
    def chains(p: Plan) -> dict[str, str]:
        return {
            c.unit: f"forward {', '.join(c.forward) or '-'}; backward {', '.join(c.backward) or '-'}"
            for c in p.prefetch
        }

    return collapse(_per_key(chains(a), chains(b), "prefetch "))


def _membership(name: str, a: tuple[str, ...], b: tuple[str, ...]) -> list[str]:
    added = [m for m in b if m not in a]
    removed = [m for m in a if m not in b]
    lines = []
    if added:
        lines.append(f"{name} gains " + join_names(added))
    if removed:
        lines.append(f"{name} loses " + join_names(removed))
    return lines


def _field_lines(name: str, x: Any, y: Any) -> list[str]:
    """``name: old -> new``; for two records of one kind, one line per
    field that differs (``dtype_request.reshard_after_forward: ...``)."""
    if x == y:
        return []
    if type(x) is type(y) and dataclasses.is_dataclass(x):
        out: list[str] = []
        for f in dataclasses.fields(x):
            if f.compare:
                out += _field_lines(f"{name}.{f.name}", getattr(x, f.name), getattr(y, f.name))
        return out
    return [f"{name}: {_changed(x, y)}"]


# Plan fields with their own readable rendering; every other field that
# differs (including ones added later) gets a generic "field: old -> new".
_SPECIAL = ("units", "reductions", "exclusions", "tensor_parallel", "checkpointing", "prefetch", "expert_modules")


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """What changes from plan ``a`` to plan ``b``, for a reviewer.

    Per concern, one line per change, FQNs that differ only in block
    indices collapsed into one line: unit changes (``unit 3 gains
    layers.{0..7}.sinks.weight``, new and removed units, settings),
    tensor-parallel styles (``lm_head: colwise_rep -> (none)``), activation
    checkpointing (``layers.{0..7}: checkpoint full -> selective``),
    reduction marks (``layers.3.norm.weight: mean -> sum``), exclusions,
    expert modules, prefetch chains, and any other field as
    ``field: old -> new``.

    Args:
        a: the plan before.
        b: the plan after.

    Returns:
        A :class:`PlanDiff`; falsy and empty when ``a == b``.

    Raises:
        TypeError: either argument is not a Plan.

    Example::

        d = fsdptx.diff_plans(fsdptx.plan_from_json(old_text), new_plan)
        if d:
            print(d)
    """
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, Plan):
            raise TypeError(f"diff_plans: {name} must be an fsdptx.Plan, got {type(value).__name__}")
    if a == b:
        return PlanDiff()
    lines = _units(a.units, b.units)
    lines += _tensor_parallel(a, b)
    lines += _checkpointing(a, b)
    lines += collapse(_per_key(a.reductions, b.reductions))
    lines += _membership("tp-replica sync exclusions", a.exclusions, b.exclusions)
    lines += _membership("expert modules", a.expert_modules, b.expert_modules)
    lines += _prefetch(a, b)
    for f in dataclasses.fields(Plan):
        if f.name in _SPECIAL or not f.compare:
            continue
        lines += _field_lines(f.name, getattr(a, f.name), getattr(b, f.name))
    if not lines:  # the same entries, listed in another order
        lines.append("the same entries in another order (units, TP assignments or prefetch chains)")
    return PlanDiff(tuple(lines))
