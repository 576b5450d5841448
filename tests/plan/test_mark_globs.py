"""How ``mark_reduction`` finds the modules a glob names, by example: ``*``
crosses dots, so a glob with literal ends matches at any depth (the property
that matches are exactly ``fnmatch``'s, in index order, is in
property_tests/plan/test_mark_glob_properties.py)."""

from __future__ import annotations

from models import module_tree

from fsdptx.model._index import ModelIndex
from fsdptx.plan.transforms._marks import _matching


def test_a_glob_with_literal_ends_still_matches_across_dots() -> None:
    index = ModelIndex.build(module_tree([["layers", "0", "attn", "norm"], ["layers", "1", "mlp", "norm"], ["norm"]]))
    assert _matching(index, ["layers*norm", "*norm", "norm"]) == {
        "layers*norm": ["layers.0.attn.norm", "layers.1.mlp.norm"],
        "*norm": ["layers.0.attn.norm", "layers.1.mlp.norm", "norm"],
        "norm": ["norm"],
    }
