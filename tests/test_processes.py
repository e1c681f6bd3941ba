"""The child-process finder the process tests share: a killed child not yet reaped is left out, not an error."""

import subprocess
import sys
import time

import psutil

from tests.processes import children_running


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
