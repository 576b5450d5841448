"""Hypothesis properties of the one name collapser and the one byte formatter
(``fsdptx.core._names``, ``fsdptx.core._sizes``): every report prints names
and sizes through them, so what they promise holds for every report.

- Round trip: expanding the labels of ``collapse_names`` gives back exactly
  the names given (none lost, none invented), each in one label only.
- Rank-stable: the labels depend on the set of names only, not on the order
  or repetitions they came in (every rank prints the same text).
- ``collapse_keyed`` never merges names that say different things, and
  each row's names are exactly what its label expands to.
- ``format_bytes`` reads back within its rounding, in one unit convention.
"""

from __future__ import annotations

import itertools
import random
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptx.core._names import ROOT, collapse_keyed, collapse_names, index_runs, name_tokens
from fsdptx.core._sizes import format_bytes

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)

# Module names as torch writes them: dotted segments, some of them indices
# (ModuleList positions), the root as "". Words include ones that look like
# indices but are not ("01") and ones with digits inside ("w1").
_words = st.sampled_from(["layers", "attn", "mlp", "experts", "sinks", "w1", "01", "q_proj", "norm"])
_segment = st.one_of(_words, st.integers(0, 12).map(str))
_names = st.one_of(st.just(""), st.lists(_segment, min_size=1, max_size=4).map(".".join))
_name_lists = st.lists(_names, max_size=30)


def _expand_runs(runs: str) -> list[str]:
    """``"0..2,5"`` -> ``["0", "1", "2", "5"]``."""
    out: list[str] = []
    for run in runs.split(","):
        lo, _, hi = run.partition("..")
        out.extend(str(i) for i in range(int(lo), int(hi or lo) + 1))
    return out


def expand(label: str) -> list[str]:
    """The names a label stands for: the inverse of the collapser, written
    independently of it (every braced segment is a set of index runs)."""
    if label == ROOT:
        return [""]
    segments = re.split(r"\.(?![^{]*\})", label)  # dots outside the braces
    choices = [_expand_runs(s[1:-1]) if s.startswith("{") else [s] for s in segments]
    return [".".join(parts) for parts in itertools.product(*choices)]


@PROPERTY_SETTINGS
@given(_name_lists)
def test_collapsed_labels_expand_to_exactly_the_names_given_each_once(names: list[str]) -> None:
    expanded = [n for label in collapse_names(names) for n in expand(label)]
    assert sorted(expanded) == sorted(set(names))  # nothing lost, nothing invented, nothing twice


@PROPERTY_SETTINGS
@given(_name_lists, st.randoms(use_true_random=False))
def test_labels_do_not_depend_on_the_order_or_repetition_of_names(names: list[str], rnd: random.Random) -> None:
    shuffled = names + names[: len(names) // 2]
    rnd.shuffle(shuffled)
    assert collapse_names(shuffled) == collapse_names(sorted(set(names)))


@PROPERTY_SETTINGS
@given(st.lists(st.tuples(_names, st.sampled_from(["mean", "sum", "colwise"])), max_size=30))
def test_keyed_rows_merge_only_names_that_say_the_same_thing(items: list[tuple[str, str]]) -> None:
    rows = collapse_keyed(items)
    assert sorted((n, k) for _label, k, names in rows for n in names) == sorted(set(items))
    for label, _key, names in rows:
        assert sorted(expand(label)) == sorted(names)


@PROPERTY_SETTINGS
@given(st.integers(0, 40), st.integers(1, 40))
def test_a_run_of_blocks_is_one_label(start: int, count: int) -> None:
    names = [f"layers.{i}.attn.sinks" for i in range(start, start + count)]
    expected = names[0] if count == 1 else f"layers.{{{start}..{start + count - 1}}}.attn.sinks"
    assert collapse_names(names) == (expected,)


@PROPERTY_SETTINGS
@given(st.lists(st.integers(0, 200), min_size=1, max_size=40))
def test_index_runs_are_ascending_and_cover_exactly_the_values(values: list[int]) -> None:
    runs = index_runs(values)
    assert [int(v) for v in _expand_runs(runs)] == sorted(set(values))


@PROPERTY_SETTINGS
@given(st.one_of(st.text(max_size=8), st.lists(st.text(max_size=8), max_size=5), st.none()))
def test_a_bare_string_is_one_name_and_a_collection_keeps_its_names(value: str | list[str] | None) -> None:
    expected = () if value is None else (value,) if isinstance(value, str) else tuple(value)
    assert name_tokens(value, "names") == expected


_SIZE = re.compile(r"^(-?\d+(?:\.\d{2})?) (B|KiB|MiB|GiB|TiB)$")
_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@PROPERTY_SETTINGS
@given(st.integers(-(2**50), 2**50))
def test_format_bytes_reads_back_within_its_rounding_in_the_largest_unit_reached(n: int) -> None:
    text = format_bytes(n)
    match = _SIZE.match(text)
    assert match is not None, text
    value, unit = float(match[1]), match[2]
    size = _UNIT[unit]
    if unit == "B":
        assert value == n and abs(n) < 2**10 and "." not in match[1]
    else:
        assert abs(value * size - n) <= 0.005 * size + 1e-9 * abs(n)
        assert 2**10 <= abs(n) and (unit == "TiB" or abs(n) < 2**10 * size)
