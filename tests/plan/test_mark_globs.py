"""How ``mark_reduction`` finds the modules a glob names: exactly
``fnmatch``'s matches (case-sensitive, ``*`` crossing dots), in index order,
whatever the glob's wildcards are."""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fsdptx.model._index import ModelIndex
from fsdptx.plan.transforms._marks import _matching

SEGMENTS = ["a", "b", "ab", "0", "1", "x]", "[y", "n*", "q?"]


def _model(paths: list[list[str]]) -> nn.Module:
    root = nn.Module()
    for path in paths:
        here = root
        for name in path:
            if name not in here._modules:
                here.add_module(name, nn.Module())
            child = here._modules[name]
            assert child is not None
            here = child
    return root


paths = st.lists(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3), min_size=1, max_size=8)
globs = st.lists(st.text(alphabet="ab01.*?[]!xyn", max_size=7), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(paths, globs)
def test_each_glob_matches_what_fnmatch_matches_in_index_order(tree: list[list[str]], patterns: list[str]) -> None:
    index = ModelIndex.build(_model(tree))
    found = _matching(index, patterns)
    assert set(found) == set(patterns)
    for glob in patterns:
        assert found[glob] == [f for f in index.module_fqns if fnmatch.fnmatchcase(f, glob)]


def test_a_glob_with_literal_ends_still_matches_across_dots() -> None:
    index = ModelIndex.build(_model([["layers", "0", "attn", "norm"], ["layers", "1", "mlp", "norm"], ["norm"]]))
    assert _matching(index, ["layers*norm", "*norm", "norm"]) == {
        "layers*norm": ["layers.0.attn.norm", "layers.1.mlp.norm"],
        "*norm": ["layers.0.attn.norm", "layers.1.mlp.norm", "norm"],
        "norm": ["norm"],
    }
