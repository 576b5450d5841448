"""The plan's records stay at the bottom, and rendering stays in one place.

``fsdptx/plan/_types.py`` holds the records every layer reads (units,
requests, reductions); at run time it imports no fsdptx module but leaves
of ``fsdptx/plan`` that import none themselves (``_style_data``, which
turns a TP style into the data an assignment compares), so any module can
import it without a cycle (a ``TYPE_CHECKING`` import for an annotation
costs nothing at run time and is allowed). Rendering a Plan as text lives in
``fsdptx/plan/_format.py`` only: a ``format_*`` function, or a helper of
``_format``, defined again in ``_types.py`` or ``_plan.py`` would be a second
renderer to keep in step. Both rules are read from the source with ``ast``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PLAN = Path(__file__).resolve().parents[2] / "fsdptx" / "plan"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``
    (their ``else:`` runs, so it is kept); function bodies count, since they
    run when called."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _runtime_nodes(other)
            continue
        yield child
        yield from _runtime_nodes(child)


def runtime_fsdptx_imports(source: str) -> list[str]:
    """``line: import`` for each import of an fsdptx module (relative, or
    absolute from ``fsdptx``) that runs when the module is imported or
    its functions are called."""
    found: list[str] = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "fsdptx"):
            found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import ...")
        elif isinstance(node, ast.Import):
            found.extend(f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "fsdptx")
    return found


def functions(source: str) -> set[str]:
    """Names of the functions and methods defined anywhere in the source."""
    return {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def module_functions(source: str) -> set[str]:
    """Names of the functions defined at module level (no methods: the
    renderer's ``PlanView`` properties share names with Plan fields)."""
    return {n.name for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def misplaced_rendering(source: str, renderer: str) -> set[str]:
    """Functions of ``source`` that render: a ``format_*``/``_format_*``
    function, or one named like a module-level function of the renderer."""
    mine = functions(source)
    return {f for f in mine if f.lstrip("_").startswith("format")} | (mine & module_functions(renderer))


def test_the_records_import_at_run_time_only_modules_that_import_no_fsdptx_module() -> None:
    source = (PLAN / "_types.py").read_text()
    found = runtime_fsdptx_imports(source)
    leaves = {
        f"{node.lineno}: from .{node.module} import ..."
        for node in _runtime_nodes(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
        and node.level == 1
        and node.module
        and (PLAN / f"{node.module}.py").is_file()
        and not runtime_fsdptx_imports((PLAN / f"{node.module}.py").read_text())
    }
    others = [f for f in found if f not in leaves]
    assert not others, "fsdptx/plan/_types.py imports fsdptx modules at run time:\n" + "\n".join(others)


def test_the_import_check_sees_module_function_and_absolute_imports_but_not_type_checking_ones() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "if TYPE_CHECKING:\n"
        "    from ..model._index import ModelIndex\n"
        "else:\n"
        "    import fsdptx.core\n"
        "from ..core._names import ROOT\n"
        "def f() -> None:\n"
        "    from fsdptx.core._sizes import format_bytes\n"
    )
    assert runtime_fsdptx_imports(source) == [
        "6: import fsdptx.core",
        "7: from ..core._names import ...",
        "9: from fsdptx.core._sizes import ...",
    ]


def test_rendering_is_defined_only_in_format() -> None:
    renderer = (PLAN / "_format.py").read_text()
    assert {"format_plan", "format_requests"} <= module_functions(renderer)
    for name in ("_types.py", "_plan.py"):
        found = misplaced_rendering((PLAN / name).read_text(), renderer)
        assert not found, f"fsdptx/plan/{name} defines rendering, which belongs in fsdptx/plan/_format.py: {sorted(found)}"


def test_the_rendering_check_names_a_format_function_and_a_copied_helper() -> None:
    renderer = "class PlanView:\n    def units(self): ...\ndef format_plan(plan): ...\ndef _reshard_cell(u): ...\n"
    source = (
        "class Verification:\n    def units(self): ...\n"
        "class Plan:\n    def __str__(self): ...\n"
        "def _format_requests(plan): ...\ndef _reshard_cell(u): ...\n"
    )
    assert misplaced_rendering(source, renderer) == {"_format_requests", "_reshard_cell"}
