"""Finding a test's child processes by their command line, and stopping a server with its own.

A child that was just killed stays a zombie until its parent reaps it, and one may exit between
listing and reading: neither has a command line to read, and neither is running, so both are left out.
"""

from __future__ import annotations

import signal
import subprocess

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


def stop_process_tree(process: subprocess.Popen, grace_s: float = 15) -> None:
    """SIGTERM `process`; if it has not exited within `grace_s`, SIGKILL it and every process under
    it. Returns once all are gone: a server's worker processes (uvicorn --workers) would otherwise
    outlive it with their database connections, and the test database could not be dropped."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        pass
    try:  # listed before the parent dies: orphans are no longer its children
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.kill()
    process.wait()
    psutil.wait_procs(tree)
