"""The child-process helpers the process tests share: a killed child not yet reaped is left out, not
an error; a server stopped outright takes its own children with it."""

import subprocess
import sys
import time

import psutil

from tests.processes import children_running, stop_process_tree


def test_a_killed_child_not_yet_reaped_is_left_out():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "marker-for-this-test"])
    try:
        assert [p.pid for p in children_running("marker-for-this-test", argument=True)] == [child.pid]
        assert [p.pid for p in children_running("marker-for")] == [child.pid]
        assert children_running("marker-for", argument=True) == []  # a whole argument only
        child.kill()
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # killed, not reaped
            time.sleep(0.01)
        assert children_running("marker-for-this-test") == []
    finally:
        child.kill()
        child.wait()


# A server that ignores SIGTERM, with a worker of its own that does too (as a uvicorn supervisor's
# workers may, mid-shutdown); the server prints the worker's pid once both ignore it.
_DEAF = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
_DEAF_WORKER = _DEAF + "import time; print(flush=True); time.sleep(600)\n"
_DEAF_SERVER = _DEAF + "\n".join(
    [
        "import subprocess, sys",
        f"worker = subprocess.Popen([sys.executable, '-c', {_DEAF_WORKER!r}], stdout=subprocess.PIPE)",
        "worker.stdout.readline()",
        "print(worker.pid, flush=True)",
        "worker.wait()",
    ]
)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, its reaper aside
    except psutil.NoSuchProcess:
        return True


def test_a_server_that_ignores_sigterm_is_killed_with_its_workers_before_stop_returns():
    server = subprocess.Popen([sys.executable, "-c", _DEAF_SERVER], stdout=subprocess.PIPE, text=True)
    worker = int(server.stdout.readline())
    try:
        stop_process_tree(server, grace_s=0.1)
        assert server.returncode == -9 and _gone(worker)
    finally:
        server.kill()
        server.wait()
        if not _gone(worker):
            psutil.Process(worker).kill()
