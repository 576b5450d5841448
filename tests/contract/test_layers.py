"""The layer rule, enforced: a lower layer never imports a higher one, and no
two fsdptx modules import each other (directly or through others).

Every ``fsdptx/**/*.py`` is parsed with ``ast``; every import counts: module
level, inside functions, under ``if TYPE_CHECKING:``, relative or absolute.
``from package import name`` is an edge to ``package.name`` when that is a
module, else to ``package``. Layers, lowest first (see docs/architecture.md):

    core < hf < model < plan < tp < apply < compat < manager < testing < cli < fsdptx (the contract)

``presets`` imports no fsdptx module at all (torch only); ``hf`` reads
models through attributes and imports ``core`` only. Modules of one layer
may import each other, without cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdptx"

LAYERS = ("core", "hf", "model", "plan", "tp", "apply", "compat", "manager", "testing", "cli", "contract")

# Upward edges still to remove, each with why; the test prints them. Keep empty
# where possible: an edge listed here that no longer exists fails the test.
ALLOWED_FOR_NOW: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "contract"
    top = parts[1]
    if top == "_contract":  # the contract's names, which fsdptx/__init__.py loads on first use
        return "contract"
    if top.startswith("_manager_"):  # the manager's private parts (its config, gradient sync)
        return "manager"
    if top == "__main__":
        return "cli"
    if top == "presets":
        return "presets"
    if top in LAYERS:
        return top
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS in tests/contract/test_layers.py")


def rank(layer: str) -> int:
    return -1 if layer == "presets" else LAYERS.index(layer)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported fsdptx module, line) for every import in the file."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "fsdptx")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "fsdptx":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
    return found


def graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: first line}."""
    mods = modules()
    known = set(mods)
    edges: dict[str, dict[str, int]] = {}
    for module, path in mods.items():
        out = edges.setdefault(module, {})
        for target, line in imports(module, path, known):
            assert target in known, f"{module}:{line} imports {target}, which is not a module of fsdptx"
            if target != module:
                out.setdefault(target, line)
    return edges


def upward_edges(edges: dict[str, dict[str, int]]) -> dict[tuple[str, str], str]:
    """Every edge that breaks the rule, with a description naming it."""
    bad: dict[tuple[str, str], str] = {}
    for module, targets in edges.items():
        mine = layer_of(module)
        for target, line in targets.items():
            theirs = layer_of(target)
            if mine == "presets":
                bad[module, target] = f"{module}:{line} imports {target}: presets imports torch only"
            elif mine == "hf" and theirs not in ("core", "hf"):
                bad[module, target] = f"{module}:{line} imports {target}: hf imports core only"
            elif rank(theirs) > rank(mine):
                bad[module, target] = f"{module}:{line} ({mine}) imports {target} ({theirs}), a higher layer"
    return bad


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_module_imports_a_higher_layer() -> None:
    bad = upward_edges(graph())
    allowed = {edge: why for edge, why in ALLOWED_FOR_NOW.items() if edge in bad}
    for (source, target), why in sorted(allowed.items()):
        print(f"ALLOWED_FOR_NOW: {source} -> {target} ({why})")
    stale = sorted(set(ALLOWED_FOR_NOW) - set(bad))
    assert not stale, f"ALLOWED_FOR_NOW lists edges that are gone or no longer upward; remove them: {stale}"
    problems = [description for edge, description in sorted(bad.items()) if edge not in ALLOWED_FOR_NOW]
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_no_import_cycles_between_modules() -> None:
    edges = graph()
    found = cycles(edges)
    described = []
    for component in found:
        members = set(component)
        described.append(
            "; ".join(
                f"{a}:{line} -> {b}" for a in component for b, line in sorted(edges[a].items()) if b in members
            )
        )
    assert not found, "import cycles:\n" + "\n".join(described)


@pytest.mark.parametrize(
    ("source", "text", "expected"),
    [
        ("core/_tree.py", "from ..plan._plan import Plan\n", "(core) imports fsdptx.plan._plan (plan)"),
        ("model/_walk.py", "def f():\n    from ..tp import tensor_parallel\n", "(model) imports fsdptx.tp (tp)"),
        ("plan/_types.py", "import fsdptx.apply._apply\n", "(plan) imports fsdptx.apply._apply (apply)"),
        ("hf/_build.py", "from fsdptx.model import _walk\n", "hf imports core only"),
    ],
)
def test_the_checker_names_an_upward_edge(source: str, text: str, expected: str) -> None:
    """The checker itself: an upward import added to a module is found and named."""
    module = module_name(PACKAGE / source)
    edges = graph()
    added: dict[str, int] = {}
    for target, line in imports(module, _FakePath(PACKAGE / source, text), set(modules())):  # type: ignore[arg-type]
        added.setdefault(target, line)
    edges[module] = {**edges[module], **added}
    descriptions = list(upward_edges(edges).values())
    assert any(expected in d for d in descriptions), descriptions


def test_the_checker_names_a_cycle() -> None:
    edges = graph()
    edges["fsdptx.plan._types"] = {**edges["fsdptx.plan._types"], "fsdptx.plan.resolve._resolver": 1}
    found = cycles(edges)
    assert any({"fsdptx.plan._types", "fsdptx.plan.resolve._resolver"} <= set(c) for c in found), found


class _FakePath:
    """A path whose text is given: what ``imports`` reads for the checker's own tests."""

    def __init__(self, path: Path, text: str) -> None:
        self.name = path.name
        self._text = text

    def read_text(self) -> str:
        return self._text

    def __str__(self) -> str:
        return self.name
