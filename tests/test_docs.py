"""The architecture and reliability pages name real files, names and tests: every `path`,
`path:name` or `tests/...py::test_name` they write in backticks exists, so a move or a rename that
forgets a page fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "architecture.md", ROOT / "RELIABILITY.md"]
# `controlplane/x.py`, `gpuworker/engine/`, `controlplane/x.py:name`, `tests/x.py::test_name`
REFERENCE = re.compile(r"`((?:controlplane|gpuworker|tests)/[\w/.]*?)(?:::?([\w.]+))?[`,]")


def _names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and the methods of its classes."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _references(page: Path) -> list[tuple[str, str | None]]:
    return [(path, name or None) for path, name in REFERENCE.findall(page.read_text())]


def test_the_page_names_at_least_the_three_paths():
    text = PAGES[0].read_text()
    for heading in ("## One request", "## One heartbeat", "## One scale action"):
        assert heading in text


def test_every_file_and_name_on_the_page_exists():
    missing = []
    for page in PAGES:
        references = _references(page)
        assert len(references) > 15, f"{page.name} should name the files it describes"
        for path, name in references:
            target = ROOT / path
            if not target.exists():
                missing.append(f"{page.name}: {path}")
            elif name is not None and not set(name.split(".")) <= _names(target):
                missing.append(f"{page.name}: {path}:{name}")
    assert missing == []


NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_the_title_counts_the_paths_the_page_follows():
    text = PAGES[0].read_text()
    title = text.splitlines()[0]
    [word] = [w for w in title.split() if w in NUMBER_WORDS]
    assert NUMBER_WORDS[word] == len(re.findall(r"^## One ", text, re.M)), title


def test_the_page_names_every_kernel_family():
    text = PAGES[0].read_text()
    kernels = ROOT / "gpuworker" / "kernels"
    families = sorted(p.name for p in kernels.iterdir() if (p / "__init__.py").exists())
    assert families, "gpuworker/kernels/ has no family packages"
    missing = [f for f in families if f"`gpuworker/kernels/{f}/`" not in text]
    assert missing == [], f"docs/architecture.md does not name these kernel folders: {missing}"


def test_the_page_gives_the_apps_in_the_layering_tests_order():
    from tests.test_layering import CONTROL_PLANE_ORDER

    text = PAGES[0].read_text()
    paragraph = next(p for p in text.split("\n\n") if "import one way, lowest first" in p)
    named = re.findall(r"`controlplane/(\w+)/`", paragraph)
    apps = [part for row in CONTROL_PLANE_ORDER for part in row if (ROOT / "controlplane" / part).is_dir()]
    assert named == apps


def test_the_readme_leaves_history_to_benchmarks():
    """Figures in the README stand without dates or work history; BENCHMARKS.md keeps when and where."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    assert "BENCHMARKS.md" in section
    assert re.findall(r"\b20\d\d-\d\d-\d\d\b|\bsessions?\b|\bcommit [0-9a-f]{7}", section) == []
