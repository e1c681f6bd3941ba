"""No module of ours shadows an installed package: a folder that Python puts on sys.path ahead of
site-packages must not hold a module or package named like an installed distribution's top-level
package. `python bench/chaos.py` puts bench/ first, so a bench/kernels.py was what transformers got
when it imported the `kernels` package."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def script_folders() -> set[Path]:
    """The folders whose modules are imported by bare name: bench/ (its scripts run as
    `python bench/x.py`), the repository root (manage.py runs from it; the bench scripts and pytest's
    `pythonpath` put it on sys.path), and the folders pytest's default import mode puts on sys.path:
    for each test module or conftest, the nearest folder above it without an __init__.py."""
    folders = {ROOT, ROOT / "bench"}
    folders |= {ROOT / path for path in PYPROJECT["tool"]["pytest"]["ini_options"].get("pythonpath", [])}
    for module in (ROOT / "tests").rglob("*.py"):
        folder = module.parent
        while (folder / "__init__.py").exists():
            folder = folder.parent
        folders.add(folder)
    return {folder.resolve() for folder in folders}


def top_level_names(folder: Path) -> set[str]:
    """Modules (x.py) and regular packages (x/__init__.py) directly in the folder. A folder without
    __init__.py is a namespace package, and a regular package of the same name wins over it."""
    return {entry.stem for entry in folder.glob("*.py")} | {entry.parent.name for entry in folder.glob("*/__init__.py")}


def shadowed(folders: set[Path], installed: dict[str, list[str]], own: str) -> list[str]:
    """'folder/name: distributions' for each name in the folders that an installed distribution
    other than our own also provides."""
    clashes = []
    for folder in sorted(folders):
        for name in sorted(top_level_names(folder)):
            others = sorted(
                {dist for dist in installed.get(name, ()) if canonicalize_name(dist) != canonicalize_name(own)}
            )
            if others:
                where = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
                clashes.append(f"{where}/{name}: the installed {', '.join(others)} has a package of that name")
    return clashes


def test_no_module_in_a_script_folder_shadows_an_installed_package():
    installed = importlib.metadata.packages_distributions()
    clashes = shadowed(script_folders(), installed, PYPROJECT["project"]["name"])
    assert clashes == [], "rename these modules: " + "; ".join(clashes)


def test_the_script_folders_include_bench_and_the_tests_that_pytest_puts_on_sys_path():
    folders = script_folders()
    assert {ROOT / "bench", ROOT, ROOT / "tests" / "kernels"} <= folders
    assert ROOT / "tests" / "controlplane" not in folders  # a package: imported as tests.controlplane


def test_a_module_named_like_an_installed_package_is_reported(tmp_path):
    (tmp_path / "pytest.py").write_text("")
    (tmp_path / "packaging").mkdir()
    (tmp_path / "packaging" / "__init__.py").write_text("")
    (tmp_path / "sqlparse").mkdir()  # no __init__.py: a namespace portion, shadows nothing
    (tmp_path / "controlplane.py").write_text("")  # our own distribution's package
    installed = importlib.metadata.packages_distributions()

    clashes = shadowed({tmp_path}, installed, PYPROJECT["project"]["name"])

    assert [clash.split(":")[0] for clash in clashes] == [f"{tmp_path}/packaging", f"{tmp_path}/pytest"]
