"""The locks in requirements/ (written by `make lock`) agree with pyproject.toml and with each other,
and every install the Makefile and the Dockerfile run takes only hashed pins from them. A requirement
added to pyproject.toml without `make lock` fails here rather than when some process imports it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")
# torch's CUDA build from PyPI pins its own Triton; the rest of the image is the run lock's.
IMAGE_OWN_BUILD = {"torch", "triton"}
# The locks are compiled for CI's and the image's Python and platform (the Makefile's `lock`).
LOCK_ENVIRONMENT = {
    "python_version": "3.11",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}
PIP_INSTALL = re.compile(r"(\bpip|\$\(PIP\)) install\b")
# The project itself, installed from the working tree with nothing else: `pip install --no-deps
# --no-build-isolation [-e] .` (the build backend comes from the lock).
PROJECT_INSTALL = re.compile(r"install --no-deps --no-build-isolation (-e )?\.(\s|$)")


def parse_lock(text: str) -> dict[str, tuple[Version, frozenset[str]]]:
    """name -> (version, hashes) of a pip requirements file with hashes, as uv writes it."""
    pins: dict[str, tuple[Version, frozenset[str]]] = {}
    name = None
    for line in text.splitlines():
        if match := PIN.match(line):
            name = canonicalize_name(match[1])
            assert name not in pins, f"{name} pinned twice"
            pins[name] = (Version(match[2]), frozenset())
        elif line.startswith("-") or (line.strip() and not line.lstrip().startswith(("#", "--hash"))):
            raise AssertionError(f"not a hashed pin: {line!r}")
        for digest in HASH.findall(line):
            version, hashes = pins[name]
            pins[name] = (version, hashes | {digest})
    return pins


def lock(name: str) -> dict[str, tuple[Version, frozenset[str]]]:
    return parse_lock((LOCKS / name).read_text())


def requirements(*, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """The project's requirements, with these extras and the build backend, that apply on the locks'
    platform."""
    texts = PYPROJECT["project"]["dependencies"] + PYPROJECT["build-system"]["requires"]
    for extra in extras:
        texts += PYPROJECT["project"]["optional-dependencies"][extra]
    found = [Requirement(text) for text in texts]
    return [req for req in found if req.marker is None or req.marker.evaluate(LOCK_ENVIRONMENT)]


def unmet(reqs: list[Requirement], pins: dict[str, tuple[Version, frozenset[str]]]) -> list[str]:
    missing = []
    for req in reqs:
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            missing.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pin[0], prereleases=True):
            missing.append(f"{req}: the lock has {pin[0]}")
    return missing


def test_every_pin_has_a_hash():
    for name in ("dev.txt", "run.txt", "image.txt", "no-deps.txt"):
        pins = lock(name)
        assert pins, name
        assert [pkg for pkg, (_, hashes) in pins.items() if not hashes] == [], name


def test_the_dev_lock_meets_every_requirement_and_extra_of_pyproject():
    assert unmet(requirements(extras=tuple(PYPROJECT["project"]["optional-dependencies"])), lock("dev.txt")) == []


def test_the_run_and_image_locks_meet_every_runtime_requirement():
    assert unmet(requirements(), lock("run.txt")) == []
    assert unmet(requirements(), lock("image.txt")) == []


def runtime_imports() -> dict[str, set[str]]:
    """Top-level modules outside the standard library that controlplane/ and gpuworker/ import ->
    the files importing them."""
    imports: dict[str, set[str]] = {}
    for folder in ("controlplane", "gpuworker"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("controlplane", "gpuworker"):
                        imports.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return imports


def test_every_module_the_runtime_imports_comes_from_the_run_lock():
    # The dev lock is a superset: a package the product imports but only dev installs (Pillow, once)
    # passes every test and breaks `make run` and the image.
    providers = importlib.metadata.packages_distributions()
    run = lock("run.txt")
    missing = {
        canonicalize_name(dist): sorted(files)[:3]
        for module, files in runtime_imports().items()
        for dist in providers.get(module, [module])
        if canonicalize_name(dist) not in run
    }
    assert missing == {}


def test_form_parsing_in_the_runtime_has_its_parser_in_the_run_lock():
    # Starlette parses forms with python-multipart, an extra it does not install; the dev lock gets it
    # by chance (through openai-agents), so tests pass while `make run` answers every upload with 400.
    parses_forms = [
        path.relative_to(ROOT)
        for folder in ("controlplane", "gpuworker")
        for path in (ROOT / folder).rglob("*.py")
        if ".form(" in path.read_text()
    ]
    if parses_forms:
        assert "python-multipart" in lock("run.txt"), f"{parses_forms} parse forms"


def test_a_requirement_the_lock_does_not_meet_is_reported():
    pins = lock("dev.txt")
    assert unmet([Requirement("no-such-package>=1")], pins) == ["no-such-package>=1: not in the lock"]
    assert unmet([Requirement("torch>=99")], pins) == [f"torch>=99: the lock has {pins['torch'][0]}"]
    assert unmet([Requirement("torch==2.13.0")], {"torch": (Version("2.13.0+cpu"), frozenset())}) == []


def test_the_run_lock_is_the_dev_locks_pins():
    dev = lock("dev.txt")
    assert {name: pin for name, pin in lock("run.txt").items() if dev.get(name) != pin} == {}


def test_the_image_lock_is_the_run_locks_pins_but_for_torchs_build():
    run, image = lock("run.txt"), lock("image.txt")
    assert sorted(run.keys() - image.keys()) == []
    assert {
        name: (run[name][0], image[name][0]) for name in run.keys() - IMAGE_OWN_BUILD if image[name] != run[name]
    } == {}
    assert image["torch"][0].public == run["torch"][0].public
    # its own build: PyPI's, not the CPU build in this machine kind's wheelhouse
    assert image["torch"][1].isdisjoint(run["torch"][1])


def test_the_no_deps_lock_pins_what_its_input_names():
    wanted = {
        canonicalize_name(match[1]): Version(match[2])
        for line in (LOCKS / "no-deps.in").read_text().splitlines()
        if (match := PIN.match(line))
    }
    assert wanted
    assert {name: version for name, (version, _) in lock("no-deps.txt").items()} == wanted


def test_every_install_takes_hashed_pins_or_only_the_project_itself():
    """pip resolving anew (a requirement without --require-hashes) is how an install drifts. The one
    other install is `make lock`'s own tool, uv, pinned by version."""
    installs = []
    for path in (ROOT / "Makefile", ROOT / "Dockerfile"):
        text = path.read_text().replace("\\\n", " ")
        installs += [
            (path.name, line.strip())
            for line in text.splitlines()
            if PIP_INSTALL.search(line) and not line.lstrip().startswith("#")
        ]
    assert len(installs) >= 5
    drifting = [
        (name, line)
        for name, line in installs
        if "--require-hashes" not in line and not PROJECT_INSTALL.search(line) and "'uv==$(UV_VERSION)'" not in line
    ]
    assert drifting == []
