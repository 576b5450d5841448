"""What changed between two plans, written like a review comment.

A plan of a 40-block model changes in 40 places at once when one setting
changes; listing each would bury the change. Lines that say the same thing
about FQNs differing only in their block indices are collapsed into one,
``layers.{0..39}.attn: checkpoint full -> selective``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core._names import collapse_keyed, join_names
from ._plan import Plan
from ._style_data import MAPPING, TYPE_KEY
from ._types import StreamStep, Unit

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

    lines = collapse(_per_key(modes(a), modes(b), "checkpoint "))
    kv = [() if p.checkpointing is None else p.checkpointing.kv_cache_off for p in (a, b)]
    return lines + _membership("KV caches checkpointing turns off", kv[0], kv[1])


def _tensor_parallel(a: Plan, b: Plan) -> list[str]:
    x, y = a.tensor_parallel, b.tensor_parallel
    assigned = [({} if t is None else {s.module: s for s in t.assignments}) for t in (x, y)]
    styles = [{m: s.style for m, s in found.items()} for found in assigned]
    lines = collapse(_per_key(styles[0], styles[1]))
    both = sorted(set(assigned[0]) & set(assigned[1]))
    # The same readable name, other settings (use_local_output, layouts ...):
    # the name leaves them out, so say which changed.
    lines += collapse(
        (m, "TP style " + _settings_change(assigned[0][m].settings, assigned[1][m].settings))
        for m in both
        if assigned[0][m].style == assigned[1][m].style and assigned[0][m].settings != assigned[1][m].settings
    )
    lines += collapse(
        (m, f"TP pattern {_short(assigned[0][m].pattern)} -> {_short(assigned[1][m].pattern)}")
        for m in both
        if assigned[0][m].pattern != assigned[1][m].pattern
    )
    if x is None or y is None:
        if x != y:
            lines.append(f"tensor parallelism: {'requested' if x is None else 'dropped'}")
        return lines
    for f in dataclasses.fields(x):
        if f.name not in ("assignments", "stream") and f.compare:
            lines += _field_lines(f"tensor_parallel.{f.name}", getattr(x, f.name), getattr(y, f.name))
    return lines + _stream(x.stream, y.stream)


def _settings_change(a: str, b: str) -> str:
    """What differs between two styles' settings
    (:func:`~fsdptx.plan._style_data.style_settings`): the class, then each
    attribute that differs, ``name old -> new``."""
    if not (a.startswith("{") and b.startswith("{")):
        return f"settings {a} -> {b}"
    x, y = json.loads(a), json.loads(b)
    parts = []
    if x.get("qualname") != y.get("qualname"):
        parts.append(f"class {x.get('qualname')} -> {y.get('qualname')}")
    old, new = x.get("attributes", {}), y.get("attributes", {})
    for name in sorted(set(old) | set(new)):
        if old.get(name, _ABSENT) != new.get(name, _ABSENT):
            parts.append(f"{name} {_encoded(old.get(name, _ABSENT))} -> {_encoded(new.get(name, _ABSENT))}")
    return "; ".join(parts)


_ABSENT = object()


def _encoded(value: Any) -> str:
    """An encoded style attribute as a reader writes it: ``Shard(1)``,
    ``(Replicate(),)``, ``bfloat16``, ``None``; ``(unset)`` where the style
    does not hold the attribute (the class's default applies)."""
    if value is _ABSENT:
        return "(unset)"
    if value is None:
        return "None"
    if isinstance(value, list):
        return "(" + ", ".join(_encoded(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if not isinstance(value, dict):
        return str(value)
    kind = value.get(TYPE_KEY)
    if kind == "Shard":
        return f"Shard({value.get('dim')})"
    if kind == "Replicate":
        return "Replicate()"
    if kind == "Partial":
        return f"Partial({value.get('reduce_op')})"
    if kind == "dtype":
        return str(value.get("name"))
    if kind == "ParallelStyle":
        inner = ", ".join(f"{k}={_encoded(v)}" for k, v in sorted(value.get("attributes", {}).items()))
        return f"{value.get('class')}({inner})"
    items = value.get("items", {}) if kind == MAPPING else value
    return "{" + ", ".join(f"{k}: {_encoded(v)}" for k, v in sorted(items.items())) + "}"


def _stream(a: tuple[StreamStep, ...], b: tuple[StreamStep, ...]) -> list[str]:
    """The residual stream's changes, per module: one line per field of a
    step that differs (``layers.{0..3}.mlp: stream takes Shard(1) ->
    whole``), steps gained or lost, and a change of order. Block indices
    collapse, so one style change reads as a few lines, not as the whole
    stream twice."""
    old = {s.module: s for s in a}
    new = {s.module: s for s in b}
    items: list[tuple[str, str]] = []
    for module, step in new.items():
        was = old.get(module)
        if was is None:
            items.append((module, f"stream gains {step.role}: {step.takes} -> {step.gives}"))
            continue
        for f in dataclasses.fields(StreamStep):
            x, y = getattr(was, f.name), getattr(step, f.name)
            if f.compare and x != y:
                items.append((module, f"stream {f.name} {_changed(x, y)}"))
    items += [(m, f"stream loses {s.role}: {s.takes} -> {s.gives}") for m, s in old.items() if m not in new]
    lines = collapse(items)
    kept = [m for m in new if m in old]
    if [m for m in old if m in new] != kept:
        shown = kept[:_ORDER_SHOWN] + ([f"... ({len(kept)} in all)"] if len(kept) > _ORDER_SHOWN else [])
        lines.append("stream order changes: now " + ", ".join(shown))
    return lines


# How many modules of a reordered stream a diff lists, in their new order.
_ORDER_SHOWN = 12


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
    tensor-parallel styles (``lm_head: colwise_rep -> (none)``; a style of
    the same name with other settings as ``b: TP style use_local_output
    True -> False``), the residual stream step by step, activation
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
