"""The sm_90 PTX of every kernel variant a test run launches, to show that a restructuring of kernel
code leaves what the GPU runs unchanged.

    # on the CPU: run kernel tests under the interpreter, compile each distinct launch for sm_90
    python -m tests.kernels.ptx_inventory record before.json -- tests/kernels -k sampling
    # on a GPU: read what the JIT compiled during a run (TRITON_CACHE_DIR)
    python -m tests.kernels.ptx_inventory cache before.json /tmp/triton-cache
    # then, after the change, the same again and
    python -m tests.kernels.ptx_inventory compare before.json after.json

An inventory maps each kernel's name to the SHA-256 of its variants' PTX, with the lines that carry
source positions and file names (.file, .loc, comments, debug sections, and the $L__tmp labels that
only the debug sections refer to: where the code of an inlined device function starts and ends) left
out, so moving or renaming code, or moving it into device functions, changes nothing while any change
to the instructions does. `compare` exits 1 when a
variant of `before` has no identical PTX in `after`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections import Counter
from pathlib import Path

_ENTRY = re.compile(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", re.M)
_POSITIONAL = re.compile(r"^\s*(\.file|\.loc|//|\$L__tmp\d+:\s*$)")


def normalized(ptx: str) -> str:
    """The PTX without source positions, file names, debug sections and debug-only labels."""
    ptx = ptx.split("\t.section\t.debug", 1)[0].split(".section .debug", 1)[0]
    return "\n".join(line for line in ptx.splitlines() if line.strip() and not _POSITIONAL.match(line))


def fingerprint(ptx: str) -> tuple[str, str]:
    """(kernel name, hash of the normalized PTX)."""
    match = _ENTRY.search(ptx)
    name = match.group(1) if match else "?"
    return name, hashlib.sha256(normalized(ptx).encode()).hexdigest()[:16]


def from_ptx(texts: list[str]) -> dict[str, list[str]]:
    inventory: dict[str, set[str]] = {}
    for text in texts:
        name, digest = fingerprint(text)
        inventory.setdefault(name, set()).add(digest)
    return {name: sorted(digests) for name, digests in sorted(inventory.items())}


def from_cache(cache_dir: Path) -> dict[str, list[str]]:
    return from_ptx([path.read_text() for path in sorted(cache_dir.rglob("*.ptx"))])


def record(pytest_args: list[str]) -> dict[str, list[str]]:
    """Run pytest with every LazyJIT launch recorded, then compile each distinct one for sm_90."""
    import pytest

    from tests.kernels.sm90_compile import compile_job, compile_jobs, record_launches

    class Recorder:
        launches: dict = {}

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionstart(self, session):
            self.patch = pytest.MonkeyPatch()
            self.launches = record_launches(self.patch)

    recorder = Recorder()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[recorder])
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"the test run failed ({code}); no inventory written")
    jobs: dict[str, dict] = {}
    for launches in recorder.launches.values():
        for launch in launches:
            job = compile_job(launch)
            jobs.setdefault(json.dumps(job, sort_keys=True, default=str), job)
    print(f"compiling {len(jobs)} distinct launches for sm_90", file=sys.stderr)
    return from_ptx(compile_jobs(list(jobs.values())))


def compare(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[str]:
    """The variants of `before` with no identical PTX in `after`, as report lines."""
    missing = []
    for name, digests in before.items():
        lost = Counter(digests) - Counter(after.get(name, []))
        missing += [f"{name}: variant {digest} changed or gone" for digest in sorted(lost)]
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("output")
    rec.add_argument("pytest_args", nargs="*")
    cache = sub.add_parser("cache")
    cache.add_argument("output")
    cache.add_argument("cache_dir")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = parser.parse_args(argv)
    if args.command == "compare":
        before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
        missing = compare(before, after)
        total = sum(len(v) for v in before.values())
        extra = sum(len(set(v) - set(before.get(k, []))) for k, v in after.items())
        print(f"{total - len(missing)} of {total} variants unchanged; {extra} variants only after")
        print("\n".join(missing))
        return 1 if missing else 0
    inventory = record(args.pytest_args) if args.command == "record" else from_cache(Path(args.cache_dir))
    Path(args.output).write_text(json.dumps(inventory, indent=1) + "\n")
    print(f"{sum(len(v) for v in inventory.values())} variants of {len(inventory)} kernels -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
