"""Pages read through selectors: no module of the UI app (views, forms, consumers, template tags,
the fragments and page helpers) touches a model's manager, builds a queryset or looks a model up
itself. Reads belong to the owning app's selectors.py, writes to its services."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
UI_APPS = ("controlplane/dashboard",)
# Queryset methods a page would call to build its own query (`values`, `get`, `all`, `first`...
# are left out: dicts and lists have them too).
QUERY_METHODS = frozenset(
    {
        "filter",
        "exclude",
        "select_related",
        "prefetch_related",
        "annotate",
        "aggregate",
        "order_by",
        "values_list",
        "only",
        "defer",
        "distinct",
        "in_bulk",
        "raw",
        "extra",
        "select_for_update",
        "get_or_create",
        "update_or_create",
        "bulk_create",
        "bulk_update",
    }
)
SHORTCUTS = frozenset({"get_object_or_404", "get_list_or_404"})


def offenders_in(source: str, name: str) -> list[str]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Attribute) and node.attr == "objects":
            found.append((node.lineno, ".objects"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in QUERY_METHODS:
            found.append((node.lineno, f".{node.func.attr}()"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in SHORTCUTS
            and node.args
            and not isinstance(node.args[0], ast.Call)
        ):
            # get_object_or_404(Model, ...) queries the model's manager; give it a selector's queryset.
            found.append((node.lineno, f"{node.func.id}() of a model, not of a selector"))
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


def test_page_modules_read_only_through_selectors():
    offenders = []
    for app in UI_APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            offenders += offenders_in(path.read_text(), str(path.relative_to(ROOT)))
    assert offenders == [], "page code queries the database itself; move each read to a selectors.py:\n" + "\n".join(
        offenders
    )


def test_the_check_finds_each_kind_of_query():
    source = """
def view(request, pk):
    a = Worker.objects.all()
    b = workers_all().filter(state="online")
    c = get_object_or_404(Worker, pk=pk)
    d = get_object_or_404(workers_all(), pk=pk)
    e = {"x": 1}.values()
"""
    assert offenders_in(source, "views.py") == [
        "views.py:3: .objects",
        "views.py:4: .filter()",
        "views.py:5: get_object_or_404() of a model, not of a selector",
    ]
