"""Loading the pytest plugin imports no torch: pytest loads it in every run
of any suite where fsdptx is installed, whether or not a test uses a
fixture. Checked in a fresh interpreter, where nothing else imported torch
first."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import fsdptx.testing

ROOT = Path(__file__).resolve().parents[2]


def fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter with this checkout first on the
    path; it prints one JSON line, returned parsed."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr
    found: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return found


LOADED = "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fsdptx'))"


def test_importing_the_plugin_module_imports_no_torch() -> None:
    found = fresh(f"import json, sys\nimport fsdptx.testing.plugin\nprint(json.dumps({LOADED}))")
    assert found == ["fsdptx", "fsdptx.testing", "fsdptx.testing.plugin"]


def test_pytest_loading_the_plugin_through_its_entry_point_imports_no_torch() -> None:
    """The way pytest loads it: the ``pytest11`` entry point, then its hooks
    (the option it adds) registered on a plugin manager."""
    code = (
        "import json, sys, importlib.metadata as md\n"
        "import pytest\n"
        "found = [e for e in md.entry_points(group='pytest11') if e.name == 'fsdptx']\n"
        "assert [e.value for e in found] == ['fsdptx.testing.plugin'], found\n"
        "plugin = found[0].load()\n"
        "pm = pytest.PytestPluginManager()\n"
        "pm.register(plugin, 'fsdptx')\n"
        f"print(json.dumps({LOADED}))"
    )
    assert "torch" not in fresh(code)


def test_a_fixture_in_use_imports_what_it_needs() -> None:
    """The other half: the names load when used, from the modules defining them."""
    code = f"import json, sys\nfrom fsdptx.testing import fake_mesh\nprint(json.dumps([fake_mesh.__module__, 'torch' in {LOADED}]))"
    assert fresh(code) == ["fsdptx.testing._mesh", True]


def test_the_lazy_names_are_the_ones_the_type_checking_imports_give() -> None:
    """``fsdptx/testing/__init__.py`` names each export twice: for type
    checkers (``if TYPE_CHECKING:`` imports) and for the loader
    (``_HOMES``); both say the same module for the same names, which are
    ``__all__``."""
    tree = ast.parse(Path(fsdptx.testing.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))
    declared = {a.name: f".{node.module}" for node in guarded.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert declared == fsdptx.testing._HOMES
    assert sorted(declared) == sorted(fsdptx.testing.__all__)
    for name in fsdptx.testing.__all__:
        assert getattr(fsdptx.testing, name).__module__ == f"fsdptx.testing{declared[name]}", name
