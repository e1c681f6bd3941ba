"""Log lines that repeat while nothing happens go to DEBUG, so an idle system's log stays readable
(`make run` prints every process's log in one terminal): the web server's access line for each
worker heartbeat (one a second per worker), and Celery's "received" and "succeeded" lines for the
fleet's periodic tasks (beat sends one every second). Each still shows at DEBUG; failures, and the
tasks' own lines when they change something, show as before."""

import logging
import re

# uvicorn's access line arguments: (client address, method, path, HTTP version, status code).
_HEARTBEAT_PATH = re.compile(r"^/internal/workers/\d+/heartbeat$")
# Celery's per-task lines: "Task x[id] received" (strategy), "Task x[id] succeeded in ..." (trace),
# and "Discarding revoked task" for a periodic check that expired in the queue on a busy host (request).
CELERY_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace", "celery.worker.request")


class HeartbeatAccessAtDebug(logging.Filter):
    """On uvicorn's access logger: a successful heartbeat's line is logged at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not (
            isinstance(args, tuple)
            and len(args) == 5
            and _HEARTBEAT_PATH.match(str(args[2]))
            and str(args[4]).startswith("2")
        ):
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_heartbeat_access_lines() -> None:
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HeartbeatAccessAtDebug) for f in access.filters):
        access.addFilter(HeartbeatAccessAtDebug())


def quiet_celery_task_lines(loglevel: int | str | None) -> None:
    """Unless the worker runs at DEBUG, Celery's per-task INFO lines are left out (its warnings
    and errors, a task's failure among them, are not)."""
    level = logging.getLevelName(loglevel.upper()) if isinstance(loglevel, str) else loglevel
    if level is None or level > logging.DEBUG:
        for name in CELERY_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
