"""The layout shows the processes: no import loops between product modules, and imports that run
one way (kernels <- attention <- models <- engine <- replica; daemon and replica apart; gpuworker
free of Django). Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("controlplane", "gpuworker")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if "migrations" not in path.parts}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules `name` imports (a package's __init__ when only the package matches)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import name`: the module package.name if there is one, else the package.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_two_product_modules_import_each_other_in_a_loop():
    assert _cycles(_graph()) == []


def test_gpuworker_layers_import_one_way():
    # Each layer may import only the layers listed after it (and itself).
    allowed = {
        "kernels": set(),
        "attention": {"kernels"},
        "models": {"kernels", "attention"},
        "engine": {"kernels", "attention", "models"},
        "replica": {"engine", "models", "contract"},
        "daemon": {"contract"},
        "contract": set(),
    }
    graph = _graph()
    wrong = []
    for name, imported in graph.items():
        if not name.startswith("gpuworker.") or name.count(".") < 2:
            continue
        layer = name.split(".")[1]
        for other in imported:
            if other.startswith("controlplane"):
                wrong.append(f"{name} -> {other}")
            elif other.startswith("gpuworker.") and other.count(".") >= 1:
                target = other.split(".")[1]
                if target != layer and target in allowed and target not in allowed[layer]:
                    wrong.append(f"{name} -> {other}")
    assert wrong == []


def test_gpuworker_imports_no_django():
    users = []
    for name, path in _modules().items():
        if not name.startswith("gpuworker"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            users += [f"{name} -> {n}" for n in names if n.split(".")[0] in ("django", "channels")]
    assert users == []


def test_control_plane_imports_only_the_contract_of_gpuworker():
    graph = _graph()
    wrong = sorted(f"{name} -> {other}" for name, imported in graph.items() if name.startswith("controlplane")
                   for other in imported if other.startswith("gpuworker") and not other.startswith("gpuworker.contract"))
    assert wrong == []
