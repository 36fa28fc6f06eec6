"""The layers, checked on the source: the core never imports Ray, the router side
(specdec.decoding) never imports torch nor the worker and device rooms, the deployments never
import the in-process engine, no module imports another's private names, the project's imports
form no cycle, and no module grows past MAX_MODULE_LINES.

Every import statement counts, including those inside functions. Files map to the module names
they install as: ``deployments/x.py`` is ``specdec.deployments.x``, ``cluster/x.py`` is
``specdec.cluster.x``. A failure lists every violation as ``file:line: what``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> the package it installs as (pyproject.toml's package-dir).
PACKAGES = {
    "specdec": "specdec",
    "deployments": "specdec.deployments",
    "cluster": "specdec.cluster",
}
RAY_SIDE = ("ray", "specdec.deployments", "specdec.cluster")
OPERATOR_ROOMS = ("specdec.tools", "specdec.bench")  # run from a shell: may import Ray lazily
# The router side: what the router deployment runs per round. It stays free of torch so that a
# router replica never loads it; these are all it may import of the project.
ROUTER_SIDE = "specdec.decoding"
ROUTER_SIDE_MAY_IMPORT = ("specdec.decoding", "specdec.config", "specdec.errors", "specdec.v1")
MAX_MODULE_LINES = 600
Violation = tuple[str, int, str]  # (file relative to the repository, line, what is wrong)


@dataclass(frozen=True)
class Import:
    """One imported name: ``modules`` are what it may load (``from a import b``: a and a.b)."""

    modules: tuple[str, ...]
    name: str | None  # the name taken from a module by ``from a import name``; None for import
    line: int
    in_function: bool


@dataclass(frozen=True)
class Source:
    path: Path
    module: str
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"

    def violation(self, line: int, what: str) -> Violation:
        return str(self.path.relative_to(ROOT)), line, what


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[Source]:
    return [
        Source(path, _module_name(path), ast.parse(path.read_text(), filename=str(path)))
        for folder in PACKAGES
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]


SOURCES = _sources()
MODULES = {s.module for s in SOURCES}


def _within(name: str, *roots: str) -> bool:
    return any(name == root or name.startswith(root + ".") for root in roots)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(src: Source) -> Iterator[Import]:
    """Every import of ``src``, with relative imports resolved to absolute module names."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    nested = {
        id(inner)
        for outer in ast.walk(src.tree)
        if isinstance(outer, functions)
        for inner in ast.walk(outer)
    }
    for node in ast.walk(src.tree):
        in_function = id(node) in nested
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import((alias.name,), None, node.lineno, in_function)
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(src, node)
            for alias in node.names:
                yield Import((base, f"{base}.{alias.name}"), alias.name, node.lineno, in_function)


def _from_module(src: Source, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <module> import ...``, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = src.module.split(".")
    package = package[: len(package) - node.level + src.is_package]
    return ".".join(package + ([node.module] if node.module else []))


def _module_aliases(src: Source) -> dict[str, str]:
    """Local name -> the project module it is bound to by an import (anywhere in the file)."""
    aliases = {}
    for node in ast.walk(src.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:  # `import a.b.c` binds `a`
                    aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                full = f"{_from_module(src, node)}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
    return {name: module for name, module in aliases.items() if _within(module, "specdec")}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return None


def _private_uses(src: Source) -> Iterator[Violation]:
    for imp in _imports(src):
        module = imp.modules[0]
        if not _within(module, "specdec"):
            continue
        if any(_is_private(part) for part in module.split(".")):
            yield src.violation(imp.line, f"imports private module {module}")
        elif imp.name is not None and _is_private(imp.name):
            yield src.violation(imp.line, f"imports {module}.{imp.name}")
    aliases = _module_aliases(src)
    for node in ast.walk(src.tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        owner = _dotted(node.value)
        if owner is None or owner.split(".")[0] not in aliases:
            continue
        module = ".".join([aliases[owner.split(".")[0]], *owner.split(".")[1:]])
        if module in MODULES:
            yield src.violation(node.lineno, f"uses {module}.{node.attr}")


def _report(violations: list[Violation], rule: str) -> str:
    lines = [f"{path}:{line}: {what}" for path, line, what in sorted(set(violations))]
    return f"{len(lines)} violation(s) of '{rule}':\n" + "\n".join(lines)


def test_the_core_never_imports_ray():
    """specdec/ outside specdec/tools/ and specdec/bench/ imports neither Ray nor the Ray side of
    the project; the tools and benchmarks import them only inside functions, so ``import
    specdec.tools.x`` needs no Ray."""
    violations = []
    for src in SOURCES:
        if not _within(src.module, "specdec") or _within(src.module, *RAY_SIDE[1:]):
            continue
        is_tool = _within(src.module, *OPERATOR_ROOMS)
        for imp in _imports(src):
            hit = next((m for m in imp.modules if _within(m, *RAY_SIDE)), None)
            if hit and not (is_tool and imp.in_function):
                where = " at module level" if is_tool else ""
                violations.append(src.violation(imp.line, f"imports {hit}{where}"))
    assert not violations, _report(violations, "the core never imports Ray")


def test_the_deployments_never_import_the_in_process_engine():
    violations = [
        src.violation(imp.line, "imports specdec.engine")
        for src in SOURCES
        if _within(src.module, "specdec.deployments")
        for imp in _imports(src)
        if any(_within(m, "specdec.engine") for m in imp.modules)
    ]
    assert not violations, _report(violations, "deployments never import specdec.engine")


def test_no_module_imports_another_modules_private_names():
    violations = [v for src in SOURCES for v in _private_uses(src)]
    assert not violations, _report(violations, "no module imports another's private names")


def test_every_core_and_tool_module_imports_without_ray():
    """Imported in a fresh interpreter where ``import ray`` (and the Ray side) fails."""
    names = sorted(s.module for s in SOURCES if not _within(s.module, *RAY_SIDE[1:]))
    script = (
        "import importlib, sys\n"
        + "".join(f"sys.modules[{blocked!r}] = None\n" for blocked in RAY_SIDE)
        + f"for name in {names!r}:\n"
        + "    importlib.import_module(name)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-4000:]


def test_the_router_side_never_imports_torch_nor_the_model_rooms():
    """specdec.decoding imports no torch (at any level) and, of the project, only itself,
    specdec.config, specdec.errors and the generated protos: so nothing it loads imports torch."""
    violations = []
    for src in SOURCES:
        if not _within(src.module, ROUTER_SIDE):
            continue
        for imp in _imports(src):
            module = imp.modules[0]
            outside = _within(module, "specdec") and not any(
                _within(m, *ROUTER_SIDE_MAY_IMPORT) for m in imp.modules
            )
            if _within(module, "torch") or outside:
                violations.append(src.violation(imp.line, f"imports {module}"))
    assert not violations, _report(violations, "the router side never imports torch")


def test_the_worker_and_device_rooms_never_import_the_router_rooms_runtime():
    """What a model replica runs (specdec.worker, specdec.device, specdec.models) imports nothing
    of the operator rooms (tools, bench) nor the in-process engine."""
    rooms = ("specdec.worker", "specdec.device", "specdec.models")
    violations = [
        src.violation(imp.line, f"imports {imp.modules[0]}")
        for src in SOURCES
        if _within(src.module, *rooms)
        for imp in _imports(src)
        if any(_within(m, *OPERATOR_ROOMS, "specdec.engine") for m in imp.modules)
    ]
    assert not violations, _report(violations, "replica rooms never import operator rooms")


def _project_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (every import, type-checking ones included)."""
    graph = {}
    for src in SOURCES:
        deps = set()
        for imp in _imports(src):
            target = next((m for m in reversed(imp.modules) if m in MODULES), None)
            if target and target != src.module and not _within(src.module, target):
                deps.add(target)
        graph[src.module] = deps
    return graph


def test_the_project_imports_form_no_cycle():
    graph = _project_graph()
    cycles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_is_longer_than_the_limit():
    long = [
        f"{src.path.relative_to(ROOT)}: {n} lines"
        for src in SOURCES
        if "_pb2" not in src.path.name
        and (n := len(src.path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    limit = f"modules over {MAX_MODULE_LINES} lines (split them by concept):"
    assert not long, "\n".join([limit, *long])


def test_every_package_is_installed():
    """pyproject.toml lists its packages by name, so a wheel (the k8s image installs one, not an
    editable tree) leaves out any package folder the list misses."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = {src.module for src in SOURCES if src.is_package}
    assert folders <= set(listed), (
        f"not in pyproject.toml's packages: {sorted(folders - set(listed))}"
    )
