"""The layout shows the processes: no import loops between product modules, and imports that run
one way (kernels <- attention <- models <- engine <- replica; daemon and replica apart; gpuworker
free of Django; the control plane's apps in one order, below). Every import counts, including those
inside functions."""

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
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts
    }


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
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
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
        "quality": {"engine", "models", "contract"},
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
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            users += [f"{name} -> {n}" for n in names if n.split(".")[0] in ("django", "channels")]
    assert users == []


def test_control_plane_imports_only_the_contract_of_gpuworker():
    graph = _graph()
    wrong = sorted(
        f"{name} -> {other}"
        for name, imported in graph.items()
        if name.startswith("controlplane")
        for other in imported
        if other.startswith("gpuworker") and not other.startswith("gpuworker.contract")
    )
    assert wrong == []


# The control plane's parts, lowest first. A part may import itself and the parts before it, never
# one after it; the parts of one row (the plumbing, the entry points) may also import each other.
# A part is an app (controlplane/<app>/) or a top-level module (controlplane/<name>.py).
CONTROL_PLANE_ORDER = (
    # The project's plumbing, below every app: the package itself (it loads the Celery app), settings
    # and their readers, secrets, the Celery app, routine-log filters, and the one wrapper services
    # publish live events through (with the embedded set-up's relay for it). It imports no app.
    ("__init__", "settings", "env", "integrations", "tokens", "celery", "routine_logs", "live_events", "live_relay"),
    ("common",),  # money, units, the client's address, validated saves: what every app shares
    ("audit",),  # who changed what: the apps below record their writes in it
    ("catalog",),  # models and deployments
    ("accounts",),  # tenants, users, API keys (a key may be limited to catalog models)
    ("billing",),  # price tiers, plans, credit, usage records and reports
    ("fleet",),  # workers, GPUs, replicas, reconcile, the autoscaler and the traffic counts it reads
    ("batches",),  # the Files and Batch APIs' files, batches and lines; billed through billing's holds
    ("gateway",),  # the public /v1 API: writes the fleet's traffic counts, routes to its replicas
    ("dashboard",),  # the pages: compose reports from billing's and fleet's parts
    ("demo",),  # `manage.py seed_demo`: creates a tenant, models and deployments through the apps' services
    # The entry points, above every app: the URL maps and WebSocket routes, the probes, /metrics,
    # the two ASGI apps and the launcher wire the apps into processes.
    ("urls", "routing", "health", "metrics", "asgi", "fleet_asgi", "launcher"),
)

# Model relations by label ("billing.Plan") are no imports, but they are dependencies too. These
# point against the order; no other may.
RELATIONS_AGAINST_THE_ORDER = {
    "accounts.Tenant.plan -> billing.Plan",  # a tenant's plan: billing prices the tenant's traffic
    "catalog.Model.price_tier -> billing.PriceTier",  # a model's price tier
    "billing.UsageRecord.replica -> fleet.Replica",  # the replica that served the request
}


def _part(module: str) -> str:
    """controlplane.fleet.services.deployments -> fleet; controlplane.urls -> urls; controlplane -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _rank() -> dict[str, int]:
    return {part: rank for rank, row in enumerate(CONTROL_PLANE_ORDER) for part in row}


def test_every_control_plane_part_has_a_place_in_the_order():
    parts = {_part(name) for name in _modules() if name.startswith("controlplane")}
    placed = set(_rank())
    assert sorted(parts - placed) == [], "place these in CONTROL_PLANE_ORDER"
    assert sorted(placed - parts) == [], "these parts of CONTROL_PLANE_ORDER no longer exist"


def test_control_plane_apps_import_only_apps_before_them():
    rank = _rank()
    wrong = sorted(
        f"{name} -> {other} ({_part(name)} comes before {_part(other)})"
        for name, imported in _graph().items()
        if name.startswith("controlplane")
        for other in imported
        if other.startswith("controlplane") and rank[_part(other)] > rank[_part(name)]
    )
    assert wrong == [], "imports against CONTROL_PLANE_ORDER:\n" + "\n".join(wrong)


def _relations() -> list[str]:
    """'app.Model.field -> app.Model' for every relation to a model named by label in the apps' models."""
    found = []
    for path in sorted((ROOT / "controlplane").glob("*/models.py")):
        app = path.parent.name
        for cls in ast.parse(path.read_text(), str(path)).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                call = node.value if isinstance(node, ast.Assign) else None
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and call.func.attr in ("ForeignKey", "OneToOneField", "ManyToManyField")
                    and call.args
                    and isinstance(call.args[0], ast.Constant)
                    and "." in str(call.args[0].value)
                ):
                    field = node.targets[0].id
                    found.append(f"{app}.{cls.name}.{field} -> {call.args[0].value}")
    return found


def test_model_relations_point_against_the_order_only_where_listed():
    rank = _rank()
    relations = _relations()
    assert "billing.CreditEntry.tenant -> accounts.Tenant" in relations  # the scan finds relations by label
    against = {r for r in relations if rank[r.split(" -> ")[1].split(".")[0]] > rank[r.split(".")[0]]}
    assert against == RELATIONS_AGAINST_THE_ORDER
