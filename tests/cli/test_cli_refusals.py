"""The CLI never exits silently, never prints a traceback for a user's
mistake, and refuses work it cannot finish: one line on stderr, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsdptx.cli._common import MAX_LAYERS, MAX_WORLD
from fsdptx.cli._main import main

FACTORIES = '''
import sys
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def exits_0():
    sys.exit(0)


def exits_3():
    raise SystemExit(3)


def no_split_is_an_int():
    model = Net()
    model._no_split_modules = 5
    return model


def fp32_strict_is_an_int():
    model = Net()
    model._keep_in_fp32_modules_strict = 5
    return model
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "fsdptx_hardening_factories.py").write_text(FACTORIES)
    (tmp_path / "fsdptx_hardening_exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fsdptx_hardening_factories"
    for name in ("fsdptx_hardening_factories", "fsdptx_hardening_exits_on_import"):
        sys.modules.pop(name, None)


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, assert exit 2 with exactly one stderr line, return it."""
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fsdptx: error: ")
    return lines[0]


def test_factory_calling_sys_exit_0_is_an_error_not_a_silent_success(
    capsys: pytest.CaptureFixture[str], factories: str
) -> None:
    line = one_line_error(capsys, "--factory", f"{factories}:exits_0")
    assert "called sys.exit(0)" in line


def test_factory_raising_system_exit_3_is_reported(capsys: pytest.CaptureFixture[str], factories: str) -> None:
    line = one_line_error(capsys, "--factory", f"{factories}:exits_3")
    assert "called sys.exit(3)" in line


def test_factory_module_exiting_on_import_is_reported(capsys: pytest.CaptureFixture[str], factories: str) -> None:
    line = one_line_error(capsys, "--factory", "fsdptx_hardening_exits_on_import:build")
    assert "importing 'fsdptx_hardening_exits_on_import'" in line and "sys.exit(0)" in line


def test_no_split_modules_of_the_wrong_type_is_one_line(capsys: pytest.CaptureFixture[str], factories: str) -> None:
    line = one_line_error(capsys, "--factory", f"{factories}:no_split_is_an_int")
    assert "cannot plan" in line and "_no_split_modules" in line


def test_keep_in_fp32_strict_of_the_wrong_type_is_one_line(capsys: pytest.CaptureFixture[str], factories: str) -> None:
    line = one_line_error(capsys, "--factory", f"{factories}:fp32_strict_is_an_int")
    assert "cannot plan" in line and "_keep_in_fp32_modules_strict" in line


@pytest.mark.parametrize("mesh", ["dp=100000000000", "dp=10000000", f"dp={MAX_WORLD},tp=2"])
def test_mesh_larger_than_the_limit_is_refused_at_once(capsys: pytest.CaptureFixture[str], mesh: str) -> None:
    start = time.perf_counter()
    line = one_line_error(capsys, "--mesh", mesh)
    assert time.perf_counter() - start < 1.0
    assert f"at most {MAX_WORLD:,}" in line


def test_mesh_at_the_limit_runs_without_simulating_every_shard(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    assert main(["plan", "--preset", "llama", "--layers", "1", "--mesh", f"dp={MAX_WORLD}"]) == 0
    out, _ = capsys.readouterr()
    assert "FSDP shards computed from shapes" in out
    assert time.perf_counter() - start < 15


def test_subprocess_without_numpy_prints_no_warning_and_exit_codes_hold(tmp_path: Path) -> None:
    # A numpy that cannot be imported, as on a torch-only install.
    (tmp_path / "numpy").mkdir()
    blocker = 'raise ModuleNotFoundError("No module named numpy", name="numpy")\n'
    (tmp_path / "numpy" / "__init__.py").write_text(blocker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    ok = subprocess.run(
        [sys.executable, "-m", "fsdptx", "plan", "--preset", "llama", "--layers", "1", "--mesh", "dp=2"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""
    assert ok.stdout.startswith("fsdptx plan: llama (preset, 1 layers) on a fake mesh dp=2 (2 ranks)")
    assert "memory per rank" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "fsdptx", "plan", "--mesh", "dp=100000000000"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert len(bad.stderr.splitlines()) == 1 and bad.stderr.startswith("fsdptx: error: ")


def test_mesh_with_a_superscript_digit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, "--mesh", "dp=²")
    assert "malformed --mesh 'dp=²'" in line


def test_layers_beyond_the_bound_are_refused_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    line = one_line_error(capsys, "--layers", "1000000")
    assert time.perf_counter() - start < 1.0
    assert f"--layers must be between 1 and {MAX_LAYERS:,}, got 1,000,000" in line


def test_replicate_only_mesh_prints_whole_parameters_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "llama", "--layers", "1", "--mesh", "dp_replicate=4", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["units"] and all(u["bytes_per_rank"] == u["bytes"] for u in data["units"])
    assert data["memory"]["params_bytes"] == data["model_bytes"]
