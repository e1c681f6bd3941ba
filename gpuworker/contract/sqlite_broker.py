"""The embedded Celery broker: a kombu transport that keeps every queue's messages in one SQLite
file, for a set-up without Redis (`make run`). The control plane's processes and the local GPU
worker daemon send and take messages through it at once.

    sqlite:///<absolute path>        e.g. sqlite:////srv/gpuserve/var/celery/broker.sqlite3

Each send is one INSERT and each take one transaction that selects the oldest message of the queue
and deletes it, under SQLite's write lock: a reader never sees half a message, two consumers never
take the same one, and a process killed at any point leaves the file consistent (unlike kombu's
filesystem transport, whose readers can open a message file before its writer has filled it:
celery/kombu#1551). An idle poll is one read in WAL mode and takes no lock. Both sides call
register() before they connect, so that kombu knows the `sqlite` scheme.

Like every kombu virtual transport, a message is gone from the file once a consumer has taken it:
one a consumer took and was killed before running is not redelivered. The fleet's messages are safe
to lose (the periodic reconcile re-sends what a lost one would have done).
"""

from __future__ import annotations

import json
import os
import sqlite3
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, virtual

SCHEME = "sqlite"
# How long a send or a take waits for another process's write lock before it counts as a broken
# connection (which Celery retries): each holds it for one small statement.
BUSY_TIMEOUT_S = 30.0
# How often a consumer with nothing to take looks again (kombu's default is 1 s).
POLLING_INTERVAL_S = 0.1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS message (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS message_queue_id ON message (queue, id);
"""


def broker_url(path: os.PathLike | str) -> str:
    return f"{SCHEME}:///{os.path.abspath(path)}"


def database_path(url: str) -> str:
    """The file a `sqlite:///<absolute path>` URL names."""
    prefix = f"{SCHEME}://"
    path = url[len(prefix) :] if url.startswith(prefix) else ""
    if not path.startswith("/"):
        raise ValueError(f"the broker URL must be {SCHEME}:///<absolute path to a file>; got {url!r}")
    return path


def connect(path: str) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are opened explicitly) with WAL journaling."""
    db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError:
        # Another process switching the file to WAL at the same moment holds the lock; it is set once for all.
        if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            db.close()
            raise
    # In WAL mode NORMAL loses nothing when a process dies; only a power cut may drop the last sends.
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(_SCHEMA)
    return db


class Channel(virtual.Channel):
    _db: sqlite3.Connection | None = None
    _db_pid: int | None = None

    @property
    def db(self) -> sqlite3.Connection:
        # A SQLite connection must not be used across fork (Celery's prefork pool): a child opens its own.
        if self._db is None or self._db_pid != os.getpid():
            self._db = connect(database_path(self.connection.client.hostname))
            self._db_pid = os.getpid()
        return self._db

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.db.execute("INSERT INTO message (queue, payload) VALUES (?, ?)", (queue, json.dumps(message)))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        oldest = "SELECT id, payload FROM message WHERE queue = ? ORDER BY id LIMIT 1"
        if self.db.execute(oldest, (queue,)).fetchone() is None:
            raise Empty()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute(oldest, (queue,)).fetchone()  # another consumer may have taken it meanwhile
            if row is not None:
                self.db.execute("DELETE FROM message WHERE id = ?", (row[0],))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        if row is None:
            raise Empty()
        return json.loads(row[1])

    def _size(self, queue: str) -> int:
        return self.db.execute("SELECT count(*) FROM message WHERE queue = ?", (queue,)).fetchone()[0]

    def _purge(self, queue: str) -> int:
        return self.db.execute("DELETE FROM message WHERE queue = ?", (queue,)).rowcount

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self._purge(queue)

    def close(self) -> None:
        super().close()
        if self._db is not None and self._db_pid == os.getpid():
            self._db.close()
        self._db = None


class Transport(virtual.Transport):
    Channel = Channel

    # The URL is a file path, which kombu's host/port parser would mangle: take it whole.
    can_parse_url = True
    default_port = 0
    polling_interval = POLLING_INTERVAL_S
    driver_type = driver_name = "sqlite"
    # A lock held past BUSY_TIMEOUT_S or an unreadable file: Celery reconnects and retries.
    connection_errors = virtual.Transport.connection_errors + (sqlite3.OperationalError,)
    channel_errors = virtual.Transport.channel_errors + (sqlite3.DatabaseError,)

    def driver_version(self) -> str:
        return sqlite3.sqlite_version


def register() -> None:
    """Lets kombu (and so Celery) resolve `sqlite://` broker URLs to this transport."""
    TRANSPORT_ALIASES[SCHEME] = f"{__name__}:Transport"
