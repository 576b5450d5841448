"""What ``python -m fsdptx`` prints names no private module
(``fsdptx.cli._report`` ...): a user can act on neither; it says what to
do instead (``add --batch/--seq`` for activations)."""

from __future__ import annotations

import re

import pytest

from fsdptx.cli._main import main

PRIVATE = re.compile(r"fsdptx(?:\.\w+)*\._\w+")
SMALL = ("plan", "--preset", "mixed", "--layers", "2")

RUNS = {
    "shape-only": (*SMALL,),
    "shape-only json": (*SMALL, "--json"),
    "traced": (*SMALL, "--seq", "64", "--mesh", "dp=2,tp=2", "--sp", "--ac", "full"),
    "traced offload": (*SMALL, "--seq", "64", "--offload"),
    "fit": (*SMALL, "--seq", "64", "--fit", "4x8GiB"),
    "bad mesh": (*SMALL, "--mesh", "dp=2,xx=2"),
    "untraceable mesh": (*SMALL, "--seq", "64", "--mesh", "dp=2,tp=2", "--sp", "--batch", "1", "--ep", "2"),
    "help": ("plan", "--help"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_the_output_names_no_private_module(capsys: pytest.CaptureFixture[str], name: str) -> None:
    main(list(RUNS[name]))
    out, err = capsys.readouterr()
    assert out or err
    assert not PRIVATE.findall(out + err)


def test_the_shape_only_memory_plan_says_how_to_count_activations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(list(SMALL)) == 0
    assert "activations not counted: add --batch/--seq for them" in capsys.readouterr().out
