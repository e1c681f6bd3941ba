"""Run a function of the test suite against SQLite, the embedded default of `make run`, while the
suite itself runs on PostgreSQL: a fresh process with the embedded settings (no DATABASE_URL, no
REDIS_URL, state under its own VAR_DIR), so that the code under test sees a real SQLite file."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_RESULT = "RESULT "
_SCRIPT = f"""
import importlib, json, sys
import django
django.setup()
from django.core.management import call_command
from django.db import connection
from django.test.utils import setup_test_environment
setup_test_environment()
assert connection.vendor == "sqlite", connection.vendor
if sys.argv[2] == "migrate":
    call_command("migrate", verbosity=0)
module, name = sys.argv[1].split(":")
print({_RESULT!r} + json.dumps(getattr(importlib.import_module(module), name)()))
"""


def run_on_sqlite(function: str, var_dir: Path, *, migrate: bool = True, timeout_s: float = 300):
    """`function` ("package.module:name") called in a new process on a new SQLite database under
    `var_dir`, after every migration when `migrate`; its result, through JSON."""
    env = {name: value for name, value in os.environ.items() if name not in ("DATABASE_URL", "REDIS_URL")}
    env.update(
        VAR_DIR=str(var_dir),
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, function, "migrate" if migrate else "as is"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    results = [line for line in done.stdout.splitlines() if line.startswith(_RESULT)]
    if done.returncode != 0 or not results:
        raise AssertionError(f"{function} on SQLite failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(results[-1][len(_RESULT) :])
