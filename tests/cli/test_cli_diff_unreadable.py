"""``python -m fsdptx diff`` on a file that is not a plan (binary, not JSON,
nested without end, a plan with a field edited into nonsense) exits 2 with
one line on stderr naming the file, never a traceback, whichever of the
two files it is."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import fsdptx
from fsdptx.cli._main import main
from fsdptx.presets import Decoder, DecoderConfig

ROOT = Path(__file__).resolve().parents[2]


def good_plan(tmp_path: Path) -> Path:
    model = Decoder(DecoderConfig(vocab=64, dim=32, hidden=64, layers=2))
    path = tmp_path / "good.json"
    path.write_text(fsdptx.plan_to_json(fsdptx.plan(model, fsdptx.shard_by_dtype)))
    return path


def _edited(edit: Callable[[dict[str, object]], None]) -> Callable[[Path], bytes]:
    def make(good: Path) -> bytes:
        data = json.loads(good.read_text())
        edit(data)
        return json.dumps(data).encode()

    return make


BAD: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "binary": (lambda good: bytes(range(256)) * 4, "not UTF-8 text"),
    "truncated": (lambda good: good.read_bytes()[:40], "is not JSON"),
    "deeply-nested": (lambda good: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "unit-without-fields": (
        _edited(lambda d: d["plan"].__setitem__("units", [{"__type__": "Unit"}])),  # type: ignore[index]
        r"plan.units[0]: a Unit needs the field(s)",
    ),
    "shard-without-dim": (
        _edited(lambda d: d["plan"].__setitem__("units", [{"__type__": "Shard"}])),  # type: ignore[index]
        "a Shard needs the field(s) ['dim']",
    ),
    "dtype-as-a-string": (
        _edited(lambda d: d["plan"]["units"][0].__setitem__("storage_dtype", "bf16")),  # type: ignore[index]
        "plan.units[0].storage_dtype must be a dtype",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("first", [True, False], ids=["bad-first", "bad-second"])
def test_a_file_that_is_not_a_plan_exits_2_with_one_line_naming_it(
    case: str, first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, reason = BAD[case]
    good = good_plan(tmp_path)
    bad = tmp_path / f"{case}.json"
    bad.write_bytes(make(good))
    code = main(["diff", str(bad), str(good)] if first else ["diff", str(good), str(bad)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fsdptx: error: ") and str(bad) in lines[0]
    assert reason in lines[0]


def test_the_command_prints_no_traceback_for_a_binary_file(tmp_path: Path) -> None:
    """The same through the real entry point, in a fresh interpreter."""
    bad = tmp_path / "binary.json"
    bad.write_bytes(bytes(range(256)))
    done = subprocess.run(
        [sys.executable, "-m", "fsdptx", "diff", str(bad), str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
