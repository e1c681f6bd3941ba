"""Finding a test's child processes by their command line.

A child that was just killed stays a zombie until its parent reaps it, and one may exit between
listing and reading: neither has a command line to read, and neither is running, so both are left out.
"""

from __future__ import annotations

import psutil


def children_running(
    marker: str, parent: int | None = None, *, recursive: bool = False, argument: bool = False
) -> list[psutil.Process]:
    """The live children of `parent` (this process by default) whose command line holds `marker`:
    anywhere, or as one whole argument when `argument` is set."""
    found = []
    for child in psutil.Process(parent).children(recursive=recursive):
        try:
            cmdline = child.cmdline()
            held = marker in cmdline if argument else marker in " ".join(cmdline)
            if held and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return found
