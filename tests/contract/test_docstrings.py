"""The public contract documents itself, and stays that way.

Every public callable of ``fsdptx`` and ``fsdptx.testing`` has a Google-style
docstring: ``Args:`` when it takes parameters, ``Returns:`` (or ``Yields:``)
when it returns something, ``Raises:`` when its own body raises, and an
``Example:`` always. A class documents its fields or constructor arguments
(``Attributes:`` or ``Args:``) and shows an example. ``fsdptx/_contract.py``
is the contract and nothing else: re-exports grouped by section, sorted
within each, and ``__all__`` listing exactly them in the same sections;
``fsdptx/__init__.py`` only loads it on first use.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

import fsdptx
import fsdptx.testing

INIT = Path(fsdptx.__file__)
CONTRACT = INIT.with_name("_contract.py")


def _public() -> dict[str, Any]:
    found = {f"fsdptx.{n}": getattr(fsdptx, n) for n in fsdptx.__all__}
    found.update({f"fsdptx.testing.{n}": getattr(fsdptx.testing, n) for n in fsdptx.testing.__all__})
    # Data (a constant) and typing aliases (Literal) document themselves
    # where they are defined and in docs/; they have no signature to check.
    return {k: v for k, v in found.items() if inspect.isclass(v) or inspect.isfunction(inspect.unwrap(v))}


PUBLIC = _public()


def _sections(doc: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^(Args|Returns|Yields|Raises|Example|Examples|Attributes):{1,2}$", doc, re.M)}


def _raises_itself(fn: Any) -> bool:
    """Whether the function's own body (not a nested function's) raises."""
    source = textwrap.dedent(inspect.getsource(inspect.unwrap(fn)))
    tree = ast.parse(source).body[0]
    assert isinstance(tree, ast.FunctionDef)
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_callable_has_the_sections_it_needs(name: str) -> None:
    obj = PUBLIC[name]
    doc = inspect.getdoc(obj) or ""
    assert doc, f"{name} has no docstring"
    found = _sections(doc)
    missing: list[str] = []
    if not found & {"Example", "Examples"}:
        missing.append("Example")
    if inspect.isclass(obj):
        fields = dataclasses.is_dataclass(obj) and dataclasses.fields(obj)
        init = obj.__init__ if "__init__" in vars(obj) and not getattr(obj, "_is_protocol", False) else None
        takes = bool(fields) or (init is not None and len(inspect.signature(init).parameters) > 1)
        if takes and not found & {"Attributes", "Args"} and not issubclass(obj, Exception):
            missing.append("Attributes or Args")
    else:
        fn = inspect.unwrap(obj)
        signature = inspect.signature(fn)
        if signature.parameters and "Args" not in found:
            missing.append("Args")
        returned = signature.return_annotation
        if returned not in (None, "None", "NoReturn", inspect.Signature.empty) and not found & {"Returns", "Yields"}:
            missing.append("Returns")
        if _raises_itself(fn) and "Raises" not in found:
            missing.append("Raises")
    assert not missing, f"{name}'s docstring lacks: {', '.join(missing)}"


@pytest.mark.parametrize("name", sorted(n for n, o in PUBLIC.items() if not inspect.isclass(o)))
def test_every_documented_argument_exists(name: str) -> None:
    """An ``Args:`` entry names a real parameter (the docs match the code)."""
    fn = inspect.unwrap(PUBLIC[name])
    doc = inspect.getdoc(fn) or ""
    block = re.search(r"^Args:\n((?:(?:    .*)?\n)+)", doc + "\n", re.M)
    if block is None:
        return
    documented = re.findall(r"^    \**(\w+)(?: \(.*?\))?:", block.group(1), re.M)
    params = set(inspect.signature(fn).parameters)
    assert set(documented) <= params, f"{name} documents {sorted(set(documented) - params)}, not parameters"


def _init_sections() -> tuple[list[list[ast.ImportFrom]], list[list[str]]]:
    """Re-exports per section, and ``__all__`` names per section, as
    ``fsdptx/_contract.py`` writes them (a section starts at a comment)."""
    tree = ast.parse(CONTRACT.read_text())
    imports: list[list[ast.ImportFrom]] = []
    lines = CONTRACT.read_text().splitlines()
    last_comment = -1
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            comment = max(i for i in range(node.lineno - 1) if lines[i].startswith("#"))
            if comment != last_comment:
                imports.append([])
                last_comment = comment
            imports[-1].append(node)
    start = next(i for i, line in enumerate(lines) if line.startswith("__all__"))
    listed: list[list[str]] = []
    for line in lines[start + 1 :]:
        text = line.strip()
        if text.startswith("#"):
            listed.append([])
        elif text.startswith('"'):
            listed[-1].append(ast.literal_eval(text.rstrip(",")))
    return imports, listed


def test_the_contract_module_holds_re_exports_and_all_and_nothing_else() -> None:
    body = ast.parse(CONTRACT.read_text()).body
    assert isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)  # the docstring
    for node in body[1:]:
        is_import = isinstance(node, ast.ImportFrom) and node.level == 1
        is_all = isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]
        assert is_import or is_all, f"fsdptx/_contract.py:{node.lineno} is neither a re-export nor __all__"


def test_init_defines_no_public_name_of_its_own() -> None:
    """``fsdptx/__init__.py`` holds only the loader: every public name
    ``fsdptx`` has comes from ``_contract``."""
    body = ast.parse(INIT.read_text()).body
    defined = {
        t.id for node in body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    } | {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert {n for n in defined if not n.startswith("_")} == set(), defined


def test_init_sections_are_sorted_and_all_lists_them_in_the_same_sections() -> None:
    imports, listed = _init_sections()
    for section in imports:
        modules = [node.module or "" for node in section]
        assert modules == sorted(modules), f"re-exports not sorted by module: {modules}"
        for node in section:
            names = [a.name for a in node.names]
            assert names == sorted(names), f"names from {node.module} not sorted: {names}"
    for names in listed:
        assert names == sorted(names), f"__all__ section not sorted: {names}"
    imported = [sorted(a.asname or a.name for node in section for a in node.names) for section in imports]
    assert imported == [sorted(names) for names in listed]  # the same names in the same sections
    assert sorted(fsdptx.__all__) == sorted(n for names in imported for n in names)
