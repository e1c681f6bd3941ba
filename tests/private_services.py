"""A PostgreSQL and a Redis of a test's own, on ports the OS chose, in temporary folders, that the
test may stop and start at will: the machine's shared services are never stopped.

Used by the outage tests and by the chaos suite (`bench/chaos.py`); nothing here imports pytest,
so a script can use it as well as a fixture.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.1)


class PrivateRedis:
    """A redis-server that keeps nothing on disk, so a restart comes back empty (as a crash of an
    unpersisted Redis would)."""

    def __init__(self, folder: Path):
        self.folder, self.port = Path(folder), free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                shutil.which("redis-server"),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.folder),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        _wait(lambda: _answers(client), 30, "the private redis-server")

    def stop(self) -> None:
        if self.running:
            self.process.terminate()
            self.process.wait(timeout=15)


def _answers(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


def _postgres_bin(name: str) -> str:
    """The newest installed server's program: Debian keeps them out of PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[4]))
    program = found[-1] if found else shutil.which(name)
    if program is None:
        raise FileNotFoundError(f"{name} is not installed (Debian: apt-get install postgresql)")
    return program


class PrivatePostgres:
    """A PostgreSQL cluster made with initdb in a folder of its own (under the system's temporary
    folder: the server refuses to run as root, and as its `postgres` user it must reach the folder),
    trusting local connections, on a free port; `stop()` is `pg_ctl stop -m fast`, as an operator
    would restart it, and `start()` brings it back on the same port with the same data."""

    def __init__(self, database: str = "gpuserve"):
        self.folder = Path(tempfile.mkdtemp(prefix="private-postgres-"))
        self.data, self.log = self.folder / "data", self.folder / "server.log"
        self.port, self.database = free_port(), database
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/{database}"
        # As root, the server's programs run as the postgres user, which must own the folder.
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user:
            owner = pwd.getpwnam(self._user)
            os.chown(self.folder, owner.pw_uid, owner.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            [_postgres_bin(program), *args],
            check=True,
            user=self._user,
            cwd=self.folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")

    @property
    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def create_database(self) -> None:
        import psycopg

        with psycopg.connect(f"postgres://postgres@127.0.0.1:{self.port}/postgres", autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.database}"')

    def remove(self) -> None:
        """Stop the server if it runs and delete its folder."""
        if self.running:
            try:
                self.stop()
            except subprocess.CalledProcessError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)
