"""How ``mark_reduction`` finds the modules a glob names: exactly
``fnmatch``'s matches (case-sensitive, ``*`` crossing dots), in index order,
whatever the glob's wildcards are."""

from __future__ import annotations

import fnmatch

from hypothesis import given, settings
from hypothesis import strategies as st
from models import module_tree

from fsdptx.model._index import ModelIndex
from fsdptx.plan.transforms._marks import _matching

SEGMENTS = ["a", "b", "ab", "0", "1", "x]", "[y", "n*", "q?"]

paths = st.lists(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3), min_size=1, max_size=8)
globs = st.lists(st.text(alphabet="ab01.*?[]!xyn", max_size=7), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(paths, globs)
def test_each_glob_matches_what_fnmatch_matches_in_index_order(tree: list[list[str]], patterns: list[str]) -> None:
    index = ModelIndex.build(module_tree(tree))
    found = _matching(index, patterns)
    assert set(found) == set(patterns)
    for glob in patterns:
        assert found[glob] == [f for f in index.module_fqns if fnmatch.fnmatchcase(f, glob)]
