"""The one name rule, the one collapser and the one byte formatter, by
example (their properties are in property_tests/core/test_names_properties.py):
the strings every report prints."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

import fsdptx
from fsdptx.core import _names, _sizes
from fsdptx.core._names import collapse_keyed, collapse_names, name_tokens
from fsdptx.core._sizes import format_bytes
from models import make_decoder


@pytest.mark.parametrize("module", [_names, _sizes], ids=["names", "sizes"])
def test_the_docstring_examples_hold(module: ModuleType) -> None:
    failures, tried = doctest.testmod(module)
    assert tried and not failures


@pytest.mark.parametrize(
    ("names", "labels"),
    [
        ([f"layers.{i}.attn.sinks" for i in range(40)], ("layers.{0..39}.attn.sinks",)),
        (["layers.0", "layers.1", "layers.2", "layers.5"], ("layers.{0..2,5}",)),
        (["", "norm"], ("<root>", "norm")),
        (["layers.10", "layers.2"], ("layers.{2,10}",)),
        # every combination of the indices: one label
        ([f"layers.{i}.experts.{e}" for i in range(2) for e in range(8)], ("layers.{0..1}.experts.{0..7}",)),
        # not every combination: split, never a label standing for a name not given
        (["a.0.b.0", "a.0.b.1", "a.1.b.0"], ("a.0.b.{0..1}", "a.1.b.0")),
        # "01" is a name, not index 1
        (["layers.01", "layers.1"], ("layers.1", "layers.01")),
    ],
)
def test_collapse_names(names: list[str], labels: tuple[str, ...]) -> None:
    assert collapse_names(names) == labels


def test_collapse_keyed_merges_only_names_that_say_the_same_thing() -> None:
    rows = collapse_keyed([("layers.0.norm", "mean"), ("layers.1.norm", "sum"), ("layers.2.norm", "mean")])
    assert [(label, key) for label, key, _names in rows] == [("layers.{0,2}.norm", "mean"), ("layers.1.norm", "sum")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [("sinks", ("sinks",)), (["sinks", "A_log"], ("sinks", "A_log")), (None, ()), ((), ()), ({"sinks"}, ("sinks",))],
)
def test_a_bare_string_is_one_name(value: object, expected: tuple[str, ...]) -> None:
    assert name_tokens(value, "names", "here") == expected


@pytest.mark.parametrize("value", [3, b"sinks", ["sinks", 3]])
def test_anything_else_is_refused_naming_the_argument(value: object) -> None:
    with pytest.raises(TypeError, match=r"^here: names must"):
        name_tokens(value, "names", "here")


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (49 * 2**20, "49.00 MiB"), (int(24.5 * 2**20), "24.50 MiB"),
     (3 * 2**30 // 2, "1.50 GiB"), (2**40, "1.00 TiB"), (-2048, "-2.00 KiB")],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_str_plan_prints_names_and_sizes_in_the_one_style() -> None:
    """The issue this module settles: ``str(plan)`` said ``layers.*.sinks
    (x4)`` and ``49.0 MiB`` where the CLI said ``layers.{0..14} x15`` and
    ``24.50 MiB``; both now print through the functions above."""
    p = fsdptx.plan(make_decoder(4), fsdptx.compose(fsdptx.shard_by_dtype, fsdptx.shard_across_blocks))
    text = str(p)
    cross = next(u for u in p.units if u.kind == "cross-block")
    assert f"cross-block  {collapse_names(cross.modules)[0]}" in text
    assert collapse_names(cross.modules) == ("layers.{0..3}.attn.sinks",)
    assert f"{len(p.units)} units, {format_bytes(sum(u.nbytes for u in p.units))} of parameters" in text
