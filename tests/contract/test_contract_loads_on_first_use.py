"""``import fsdptx`` imports no torch; the contract's names load on first
use, all at once, from ``fsdptx/_contract.py``, and are the same objects
the defining modules hold. ``fsdptx.plan`` is the function whichever of
the function and the subpackage ``fsdptx.plan`` is imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fsdptx

ROOT = Path(__file__).resolve().parents[2]


def fresh(code: str) -> object:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_import_fsdptx_imports_no_torch_and_a_name_read_loads_them() -> None:
    code = (
        "import json, sys\n"
        "import fsdptx\n"
        "before = 'torch' in sys.modules\n"
        "fsdptx.compose\n"
        "print(json.dumps([before, 'torch' in sys.modules]))"
    )
    assert fresh(code) == [False, True]


def test_fsdptx_plan_stays_the_function_when_the_subpackage_is_imported_first() -> None:
    code = (
        "import json\n"
        "import fsdptx\n"
        "from fsdptx.plan import _json\n"
        "import fsdptx.plan._diff\n"
        "from fsdptx import plan\n"
        "print(json.dumps([callable(fsdptx.plan), fsdptx.plan.__module__, plan is fsdptx.plan]))"
    )
    assert fresh(code) == [True, "fsdptx.plan._compose", True]


def test_every_name_is_the_object_its_defining_module_holds() -> None:
    from fsdptx import _contract

    for name in fsdptx.__all__:
        assert getattr(fsdptx, name) is getattr(_contract, name), name
    assert set(fsdptx.__all__) <= set(dir(fsdptx))


def test_a_name_outside_the_contract_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'fsdptx' has no attribute 'not_a_name'"):
        fsdptx.not_a_name  # type: ignore[attr-defined]  # noqa: B018
