"""The package's imports form no cycle, and no module uses another's private names.

Read from the source with ``ast``, so the check covers every module whether
or not a test imports it. Imports under ``if TYPE_CHECKING:`` count too: a
cycle that only type checkers see is still a cycle in the design.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kuralle_es"

#: Imports of a private name written before the name was made public; each
#: module named here is to switch to the public name (``store.retry_schema_setup``).
#: Never add to this set.


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(current: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute module an ``ImportFrom`` names."""
    if level == 0:
        return target or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def modules() -> dict[str, tuple[Path, ast.Module]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[module_name(path)] = (path, ast.parse(path.read_text(encoding="utf-8")))
    return found


def internal_imports(
    name: str, path: Path, tree: ast.Module, known: set[str]
) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for each import of a package module."""
    out: list[tuple[str, list[str]]] = []
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = resolve(name, is_package, node.level, node.module)
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            if submodules:
                out.extend((sub, []) for sub in submodules)
            elif target in known:
                out.append((target, names))
        elif isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names if alias.name in known)
    return out


def test_the_package_has_no_import_cycle() -> None:
    found = modules()
    known = set(found)
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in found.items():
        graph[name] = {
            target
            for target, _ in internal_imports(name, path, tree, known)
            # A package's __init__ re-exports its modules; importing the package
            # from inside it is how submodules reach their siblings' package.
            if target != name and not name.startswith(target + ".")
        }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_imports_another_modules_private_names() -> None:
    found = modules()
    known = set(found)
    offences = []
    for name, (path, tree) in found.items():
        for target, names in internal_imports(name, path, tree, known):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                offences.append(f"{name} imports {private} from {target}")
        imported_modules = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for alias in node.names
            if f"{resolve(name, path.name == '__init__.py', node.level, node.module)}.{alias.name}"
            in known
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported_modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offences.append(f"{name} uses {node.value.id}.{node.attr}")
    assert offences == []


def runtime_imports(tree: ast.Module) -> ast.Module:
    """The module without its ``if TYPE_CHECKING:`` blocks (imports for type hints only)."""
    body = [
        node
        for node in tree.body
        if not (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        )
    ]
    return ast.Module(body=body, type_ignores=[])


def test_the_readme_lists_modules_so_that_each_imports_only_those_above_it() -> None:
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Architecture", 1)[1].split("```", 2)[1]
    listed = [f"kuralle_es.{name}" for name in re.findall(r"\b([a-z_]+)\.py\b", section)]
    found = modules()
    known = set(found)
    assert set(listed) <= known, "the README names a module that does not exist"
    position = {name: i for i, name in enumerate(listed)}
    upward = []
    for name in listed:
        path, tree = found[name]
        for target, _ in internal_imports(name, path, runtime_imports(tree), known):
            if target in position and position[target] > position[name]:
                upward.append(f"{name} imports {target}, listed below it")
    assert upward == []
