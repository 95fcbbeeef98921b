"""The package's imports form no cycle, and no module uses another's private names.

Read from the source with ``ast``, so the check covers every module whether
or not a test imports it. Imports under ``if TYPE_CHECKING:`` count too: a
cycle that only type checkers see is still a cycle in the design.
"""

from __future__ import annotations

import ast
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


#: The layers of the package, lowest first (README.md, "Architecture"): a module
#: imports only modules of its own layer or of a layer below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kuralle_es.errors",
        "kuralle_es.shapes",
        "kuralle_es._callables",
        "kuralle_es._durations",
        "kuralle_es._crash",
        "kuralle_es._unicode",
        "kuralle_es._lookup",
        "kuralle_es._clock",
        "kuralle_es.redaction",
    ),
    ("kuralle_es._journal",),
    ("kuralle_es.views", "kuralle_es.events"),
    ("kuralle_es._definitions",),
    ("kuralle_es._runtime",),
    ("kuralle_es._operations",),
    ("kuralle_es.testing",),
    ("kuralle_es",),
    (
        "kuralle_es.examples",
        "kuralle_es.cli",
        "kuralle_es.dashboard",
        "kuralle_es.http",
        "kuralle_es._serving",
        "kuralle_es.integrations",
    ),
)


def layer_of(module: str) -> int:
    """The layer of ``module``: the one whose longest prefix names it."""
    best, found = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found >= 0, f"{module} is in no layer; add it to LAYERS"
    return found


def test_every_module_imports_only_its_own_layer_or_those_below() -> None:
    found = modules()
    known = set(found)
    upward = []
    for name, (path, tree) in found.items():
        for target, _ in internal_imports(name, path, runtime_imports(tree), known):
            if target == "kuralle_es" and name.startswith("kuralle_es."):
                if layer_of(name) < layer_of("kuralle_es"):
                    upward.append(f"{name} imports the package's public API from below it")
                continue
            if layer_of(target) > layer_of(name):
                upward.append(f"{name} imports {target}, a layer above it")
    assert upward == []


def test_the_readme_names_every_layer_and_package() -> None:
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Architecture", 1)[1].split("```", 2)[1]
    for prefixes in LAYERS:
        for prefix in prefixes:
            short = prefix.removeprefix("kuralle_es").lstrip(".") or "__init__.py"
            assert short in section, f"README.md's Architecture does not name {short}"


#: The modules that may call the ``Run`` aggregate's commands: the aggregate
#: itself, the one writer and its saver (every other module hands the writer
#: its changes), and the changes made from outside a turn.
WRITERS = {
    "kuralle_es._journal.run",
    "kuralle_es._runtime.writer",
    "kuralle_es._runtime.leased_saver",
    "kuralle_es._runtime.run_changes",
}


def run_commands() -> set[str]:
    """The public methods of ``Run`` that trigger events (its commands)."""
    _, tree = modules()["kuralle_es._journal.run"]
    [run] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run"]
    commands = set()
    for node in run.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            triggers = any(
                isinstance(n, ast.Attribute) and n.attr in ("trigger_event", "abort", "finish")
                for n in ast.walk(node)
            )
            if triggers:
                commands.add(node.name)
    return commands


def names_holding_runs(function: ast.AST) -> set[str]:
    """Names a function binds to a ``Run``: annotated so, or conventionally named."""
    held = {"run", "latest", "original", "existing", "fork", "made"}
    for node in ast.walk(function):
        if not isinstance(node, ast.arg) or node.annotation is None:
            continue
        if "Run" in {n.id for n in ast.walk(node.annotation) if isinstance(n, ast.Name)}:
            held.add(node.arg)
    return held


def test_only_the_writer_changes_a_run() -> None:
    commands = run_commands()
    assert {"start_step", "pause", "accept_signal", "cancel"} <= commands
    offences = []
    for name, (_, tree) in modules().items():
        if name in WRITERS:
            continue
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            held = names_holding_runs(function)
            for node in ast.walk(function):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in commands
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in held
                ):
                    offences.append(f"{name}.{function.name} calls {node.func.value.id}."
                                    f"{node.func.attr}()")  # fmt: skip
    assert offences == []


def test_every_module_says_its_one_job_in_its_first_docstring_line() -> None:
    """docs/architecture.md sends a reader to the modules: each one's first line
    says what it holds, so a listing of first lines is a map of the house."""
    silent = [
        name
        for name, (_, tree) in modules().items()
        if not (ast.get_docstring(tree) or "").strip().splitlines()[:1]
    ]
    assert silent == []
