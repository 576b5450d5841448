"""Names: the one rule for arguments that hold names, and the one way a list
of module names is shortened for people to read.

Every argument and model declaration that holds names (fp32 tokens, block
globs, cross-block names, expert globs, Hugging Face's ``_keep_in_fp32_*``)
goes through :func:`name_tokens`, so ``"sinks"`` means the one name
``sinks`` everywhere: iterated as a string it would be its letters and pin
every name containing an ``i``.

Every report that lists module names (``str(plan)``, plan diffs, the CLI's
text and HTML reports, warnings) goes through :func:`collapse_names`, so a
40-block model reads ``layers.{0..39}.attn.sinks`` in all of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TypeVar

__all__ = [
    "ROOT",
    "Names",
    "collapse_keyed",
    "collapse_names",
    "index_runs",
    "join_names",
    "name_tokens",
    "natural_key",
]

# A bare string is one name; otherwise any iterable of strings.
Names = str | Iterable[str]

# How the model root (FQN "") is shown: an empty label would read as nothing.
ROOT = "<root>"

_K = TypeVar("_K")

# A dotted segment that is a canonical non-negative integer (no sign, no
# leading zero), so reading it as an int and writing it back gives the same
# segment: "01" stays a name, not index 1.
_INDEX = re.compile(r"(?<![^.])(?:0|[1-9][0-9]*)(?![^.])")


def name_tokens(value: object, argument: str, where: str = "") -> tuple[str, ...]:
    """The one reading of an argument that holds names.

    Args:
        value: ``None`` (no names), one ``str`` (one name, never its
            letters), or an iterable of ``str``.
        argument: the argument's or attribute's name, for the error.
        where: the function or class reading it, for the error.

    Returns:
        The names as a tuple, in the given order.

    Raises:
        TypeError: ``value`` is neither, or holds something that is not a
            ``str``; the message names ``argument`` and the bad items.

    Example:
        >>> name_tokens("sinks", "fp32_compute_module_names")
        ('sinks',)
        >>> name_tokens(["sinks", "A_log"], "fp32_compute_module_names")
        ('sinks', 'A_log')
    """
    prefix = f"{where}: " if where else ""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (bytes, bytearray)) or not isinstance(value, Iterable):
        raise TypeError(f"{prefix}{argument} must be a name (str) or an iterable of names, got {type(value).__name__}")
    items = tuple(value)
    bad = [v for v in items if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{prefix}{argument} must hold names (str), got {bad!r}")
    return items  # every item was just checked to be a str


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key reading index segments as numbers (``layers.2`` before
    ``layers.10``): the same on every rank, whatever order names came in.

    Example:
        >>> sorted(["layers.10", "layers.2"], key=natural_key)
        ['layers.2', 'layers.10']
    """
    # isdigit first: most segments are words, and the regex is the dearer test.
    return tuple([(0, int(s)) if s.isdigit() and _INDEX.fullmatch(s) else (1, s) for s in name.split(".")])


def index_runs(values: Iterable[int]) -> str:
    """Integers as runs, the way every report writes a set of indices.

    Args:
        values: the indices; duplicates count once, order does not matter.

    Returns:
        Ascending runs joined by ``,``, a run of two or more as ``a..b``.

    Example:
        >>> index_runs([5, 0, 1, 2])
        '0..2,5'
    """
    ordered = sorted(set(values))
    if not ordered:
        return ""
    runs: list[str] = []
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ",".join(runs)


def _braced(values: Iterable[int]) -> str:
    """``[5]`` -> ``5``; ``[0, 1, 2, 5]`` -> ``{0..2,5}``."""
    runs = index_runs(values)
    return runs if runs.isdigit() else "{" + runs + "}"


def _split(name: str) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    """A name's segments with each index segment as ``None``, and the indices."""
    segments = name.split(".")
    shape = tuple(None if _INDEX.fullmatch(s) else s for s in segments)
    return shape, tuple(int(s) for s in segments if _INDEX.fullmatch(s))


def _labels(
    shape: tuple[str | None, ...], members: list[tuple[int, ...]]
) -> list[tuple[str, list[tuple[int, ...]]]]:
    """Labels covering exactly ``members`` (index tuples of one shape), each
    with the members it stands for: one label when they are every
    combination of their per-position values, else split on the first
    index and each part collapsed on its own (so a label never stands for a
    name not given)."""
    columns = list(zip(*members))
    product = 1
    for column in columns:
        product *= len(set(column))
    if product == len(members):
        values = iter(columns)
        label = ".".join(_braced(next(values)) if s is None else s for s in shape)
        return [(label or ROOT, members)]
    by_first: dict[int, list[tuple[int, ...]]] = {}
    for m in members:
        by_first.setdefault(m[0], []).append(m[1:])
    at = shape.index(None)
    out: list[tuple[str, list[tuple[int, ...]]]] = []
    for first in sorted(by_first):
        fixed = (*shape[:at], str(first), *shape[at + 1 :])
        out.extend((label, [(first, *m) for m in part]) for label, part in _labels(fixed, by_first[first]))
    return out


def _name(shape: tuple[str | None, ...], indices: tuple[int, ...]) -> str:
    values = iter(indices)
    return ".".join(str(next(values)) if s is None else s for s in shape)


def collapse_keyed(items: Iterable[tuple[str, _K]]) -> list[tuple[str, _K, tuple[str, ...]]]:
    """``(name, key)`` pairs as ``(label, key, names)`` rows: names of one
    pattern with equal keys share a row, their indices braced.

    This is how every report collapses a 40-block model's 40 identical lines
    into one: the key is what the line says about the name (a diff's change,
    a TP style, a unit's settings), and only names saying the same thing are
    merged.

    Args:
        items: ``(module name, key)`` pairs; the key must be hashable.
            Repeated pairs count once.

    Returns:
        One ``(label, key, names)`` per row: ``label`` covers exactly the
        row's ``names`` (a set that is not every combination of its
        indices is split into several rows; the root ``""`` is shown as
        ``<root>``), ``names`` in index order. Rows are in the order of
        their (pattern, key)'s first appearance in ``items`` (callers pass
        names in forward or FQN order), then by index.

    Example:
        >>> collapse_keyed([("layers.0.norm", "mean"), ("layers.1.norm", "mean"), ("head", "sum")])
        [('layers.{0..1}.norm', 'mean', ('layers.0.norm', 'layers.1.norm')), ('head', 'sum', ('head',))]
    """
    groups: dict[tuple[tuple[str | None, ...], _K], dict[tuple[int, ...], None]] = {}
    for name, key in items:
        shape, indices = _split(name)
        groups.setdefault((shape, key), {})[indices] = None
    return [
        (label, key, tuple(_name(shape, m) for m in members))
        for (shape, key), found in groups.items()
        for label, members in _labels(shape, sorted(found))
    ]


def collapse_names(names: Iterable[str]) -> tuple[str, ...]:
    """Module names shortened for reading, losing none.

    Args:
        names: module FQNs (``""`` is the root, shown as ``<root>``);
            duplicates count once, order does not matter.

    Returns:
        Labels covering exactly ``names``: names that differ only in index
        segments share one label, each varying index written as a braced
        set of runs (``{0..39}``, ``{0..2,5}``). Ordered by each label's
        first name in natural order (``layers.2`` before ``layers.10``), so
        every rank prints the same text for the same names (labels of one
        pattern stay together, by index).

    Example:
        >>> collapse_names(["layers.1.attn.sinks", "layers.0.attn.sinks", "norm"])
        ('layers.{0..1}.attn.sinks', 'norm')
    """
    ordered = sorted(dict.fromkeys(names), key=natural_key)
    return tuple(label for label, _key, _n in collapse_keyed((n, None) for n in ordered))


def join_names(names: Sequence[str]) -> str:
    """:func:`collapse_names` joined with ``", "``: one cell of a report.

    Example:
        >>> join_names(["layers.0.mlp", "layers.1.mlp"])
        'layers.{0..1}.mlp'
    """
    return ", ".join(collapse_names(names))
