"""Lines that repeat at idle go to DEBUG: heartbeats' access lines and Celery's per-task lines."""

import logging

import pytest

from controlplane.fleet.tasks import mark_lost_workers, reconcile
from controlplane.routine_logs import (
    CELERY_TASK_LOGGERS,
    HeartbeatAccessAtDebug,
    quiet_celery_task_lines,
    quiet_heartbeat_access_lines,
)
from tests.controlplane.factories import DeploymentFactory, GpuFactory
from tests.controlplane.fleet.conftest import make_worker


@pytest.fixture
def access_log(caplog):
    """uvicorn's access logger, filtered as the ASGI app sets it up, logging into caplog."""
    logger = logging.getLogger("uvicorn.access")
    filters, level = list(logger.filters), logger.level
    quiet_heartbeat_access_lines()
    quiet_heartbeat_access_lines()  # idempotent: one filter however often the app is imported
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    yield logger
    logger.filters[:] = filters
    logger.setLevel(level)


def _access(logger, path: str, status: int) -> None:
    # The arguments uvicorn's h11/httptools protocols log each request with.
    logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", path, "1.1", status)


def test_a_heartbeat_access_line_is_left_out_at_info(access_log, caplog):
    _access(access_log, "/internal/workers/7/heartbeat", 200)
    _access(access_log, "/v1/chat/completions", 200)
    _access(access_log, "/internal/workers/7/heartbeat", 403)  # a refused heartbeat is news
    _access(access_log, "/internal/workers/register", 200)
    assert [(r.levelname, r.args[2], r.args[4]) for r in caplog.records] == [
        ("INFO", "/v1/chat/completions", 200),
        ("INFO", "/internal/workers/7/heartbeat", 403),
        ("INFO", "/internal/workers/register", 200),
    ]
    assert sum(isinstance(f, HeartbeatAccessAtDebug) for f in access_log.filters) == 1


def test_a_heartbeat_access_line_shows_at_debug(access_log, caplog):
    caplog.set_level(logging.DEBUG, logger="uvicorn.access")
    _access(access_log, "/internal/workers/7/heartbeat", 200)
    [record] = caplog.records
    assert record.levelname == "DEBUG" and record.getMessage().endswith(
        '"POST /internal/workers/7/heartbeat HTTP/1.1" 200'
    )


@pytest.fixture
def celery_task_loggers():
    levels = {name: logging.getLogger(name).level for name in CELERY_TASK_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.mark.parametrize(
    ("loglevel", "quiet"),
    [("INFO", True), (logging.INFO, True), ("WARNING", True), ("DEBUG", False), (logging.DEBUG, False)],
)
def test_celery_task_lines_are_left_out_unless_the_worker_runs_at_debug(celery_task_loggers, loglevel, quiet):
    for name in CELERY_TASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    quiet_celery_task_lines(loglevel)
    # The loggers' own levels, not isEnabledFor: that also reads their parents' and the global
    # logging.disable, which other tests in the same process may have changed.
    for name in CELERY_TASK_LOGGERS:
        level = logging.getLogger(name).level
        # Quiet: INFO left out, warnings and errors (a failed task) kept; else left as configured.
        assert level == (logging.WARNING if quiet else logging.NOTSET)


@pytest.mark.django_db
def test_fleet_tasks_log_only_when_they_change_something(caplog):
    caplog.set_level(logging.INFO, logger="controlplane.fleet.tasks")
    make_worker()
    mark_lost_workers()  # the first check starts the lost-worker judge's watch, and says so
    caplog.clear()
    assert mark_lost_workers() == 0 and reconcile()["placed"] == 0
    assert caplog.records == []
    GpuFactory(worker=make_worker(), index=0)
    DeploymentFactory(desired_replicas=1)
    assert reconcile()["placed"] == 1
    [record] = caplog.records
    assert record.levelname == "INFO" and "1 replica(s) placed" in record.getMessage()
