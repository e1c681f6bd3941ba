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
