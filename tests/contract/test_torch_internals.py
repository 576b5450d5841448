"""Private torch APIs live in one file: ``fsdptx/core/_torch_internals.py``.

Every other ``fsdptx/**/*.py`` is parsed with ``ast`` and may not import a
torch module or name whose path has a private part (``torch._subclasses``,
``placement_types._StridedShard``), reach one through an attribute
(``torch._foreach_copy_``, ``dist.distributed_c10d._resolve_process_group``)
or read a private attribute of a torch object fsdptx is known to need
(``_local_tensor``, ``_fsdp_param_groups``, ``_base``, ...), by attribute or
by name in a string (``getattr(x, "_unsharded_param")``,
``"torch._inductor"``). A torch upgrade that moves one then breaks in that
file, and nowhere else, with the one exception listed in ``ALLOWED``.

Out of scope: aten operator names in strings (the selective-checkpointing
save list names ``aten._scaled_dot_product_*`` ops, as torchtitan's does),
and ``nn.Module``'s own ``_parameters``/``_modules``/``_buffers``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdptx"
INTERNALS = PACKAGE / "core" / "_torch_internals.py"

# Private attributes of torch objects (DTensor, FSDP state and parameters,
# process groups, inductor's config) that fsdptx reads: only through the file.
TORCH_PRIVATE_ATTRIBUTES = frozenset(
    {
        "_local_tensor",
        "_get_fsdp_state",
        "_fsdp_param_groups",
        "_is_root",
        "_unsharded_param",
        "_micro_pipeline_tp",
        "_op_dispatcher",
        "_resolve_process_group",
        "_get_registry",
        "_base",
        "_version",
        "_checkpoint_wrapped_module",
        "_orig_mod",
        "_fsdp_wrapped_module",
        "_mod_tracker",
        "_update_peak_stats",
        "_flatten",
        "_unflatten",
        "_overloadpacket",
        "_schema",
    }
)


# (file, private name) -> why it is used there rather than through the file.
ALLOWED: dict[tuple[str, str], str] = {
    ("fsdptx/cli/_trace.py", "_mod_tracker"): "the trace's FSDPMemTracker subclass reads its base's module tracker",
    ("fsdptx/cli/_trace.py", "_update_peak_stats"): "the trace's FSDPMemTracker subclass overrides its base's hook",
}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _dotted(node: ast.expr) -> str | None:
    """``torch._C._get_dispatch_mode`` for an attribute chain rooted at a name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def violations(path: Path) -> list[str]:
    """Every private torch use in ``path``, as ``line: what``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    torch_aliases = {"torch"}
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    torch_aliases.add((alias.asname or alias.name).split(".")[0])
                    if _private(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                torch_aliases.add(alias.asname or alias.name)
                if _private(f"{node.module}.{alias.name}"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if node.attr in TORCH_PRIVATE_ATTRIBUTES:
                found.append(f"{node.lineno}: .{node.attr}")
            elif dotted is not None and dotted.split(".")[0] in torch_aliases and _private(dotted.split(".", 1)[-1]):
                found.append(f"{node.lineno}: {dotted}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in TORCH_PRIVATE_ATTRIBUTES or node.value.startswith("torch._"):
                found.append(f"{node.lineno}: {node.value!r} (by name)")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in TORCH_PRIVATE_ATTRIBUTES:
                    found.append(f"{item.lineno}: def {item.name} (overrides a torch class's private method)")
    return sorted(set(found), key=lambda v: int(v.split(":")[0]))


def package_files() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p != INTERNALS]


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def _unexplained(path: Path) -> list[str]:
    return [v for v in violations(path) if not any((_rel(path), name) in ALLOWED for name in _names_in(v))]


def _names_in(violation: str) -> list[str]:
    text = violation.split(":", 1)[1]
    return [name for name in TORCH_PRIVATE_ATTRIBUTES if name in text]


@pytest.mark.parametrize("path", package_files(), ids=_rel)
def test_no_module_but_torch_internals_uses_a_private_torch_api(path: Path) -> None:
    found = _unexplained(path)
    assert not found, f"{path.relative_to(PACKAGE.parent)} uses private torch APIs; go through core/_torch_internals:\n" + "\n".join(found)


def test_the_check_sees_each_kind_of_private_use(tmp_path: Path) -> None:
    """The checker itself: each way to reach a private torch name is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch.distributed._functional_collectives as funcol\n"
        "from torch.distributed.tensor.placement_types import _StridedShard\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "torch._foreach_copy_([], [])\n"
        "dist.distributed_c10d._resolve_process_group(None)\n"
        "x = t._local_tensor\n"
        "y = getattr(fp, '_unsharded_param', None)\n"
        "z = torch.float32\n"
        "self._parameters\n"
        "b = t._base\n"
        "importlib.import_module('torch._inductor.config')\n"
        "class T(Tracker):\n"
        "    def _update_peak_stats(self): ...\n"
    )
    found = violations(sample)
    assert [v.split(":")[0] for v in found] == ["3", "4", "5", "6", "7", "8", "9", "12", "13", "15"], found


def test_every_allowed_exception_is_still_used() -> None:
    """An entry of ``ALLOWED`` that no longer matches anything is stale."""
    for (file, name), why in ALLOWED.items():
        found = violations(PACKAGE.parent / file)
        assert any(name in v for v in found), f"{file}: {name} ({why}) is no longer used; drop it from ALLOWED"


def test_the_internals_file_exists_and_is_the_one_exempted() -> None:
    assert INTERNALS.is_file()
    assert violations(INTERNALS), "the internals file holds private torch names, or this test checks nothing"
