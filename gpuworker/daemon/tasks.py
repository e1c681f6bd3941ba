"""The daemon's Celery side: its app (broker settings from registration) and the control tasks
of the contract (gpuworker.contract.tasks). A task with bad arguments is rejected with a logged
reason and no retry; a good one only hands a command to the agent, so tasks never block on a model.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from celery import Celery

from gpuworker.contract import sqlite_broker
from gpuworker.contract.tasks import (
    DRAIN_WORKER,
    LOAD_MODEL,
    MEASURE_QUALITY,
    STAGE_WEIGHTS,
    UNLOAD_MODEL,
    DrainWorker,
    LoadModel,
    MeasureQuality,
    StageWeights,
    TaskArgumentError,
    UnloadModel,
    parse_task,
)

logger = logging.getLogger(__name__)


class TaskHandler(Protocol):
    def load(self, task: LoadModel) -> None: ...
    def unload(self, task: UnloadModel) -> None: ...
    def drain(self, task: DrainWorker) -> None: ...
    def stage(self, task: StageWeights) -> None: ...
    def measure(self, task: MeasureQuality) -> None: ...


def register_tasks(app: Celery, handler: TaskHandler) -> None:
    def consume(name: str, handle: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                task = parse_task(name, args, kwargs)
            except TaskArgumentError as exc:
                logger.error("rejected %s: %s (arguments: %r %r)", name, exc, args, kwargs)
                return
            logger.info("accepted %s", task)
            handle(task)

        run.__name__ = name.rpartition(".")[2]
        return run

    for name, handle in (
        (LOAD_MODEL, handler.load),
        (UNLOAD_MODEL, handler.unload),
        (DRAIN_WORKER, handler.drain),
        (STAGE_WEIGHTS, handler.stage),
        (MEASURE_QUALITY, handler.measure),
    ):
        app.task(name=name)(consume(name, handle))


def build_celery_app(*, worker_name: str, broker_url: str, transport_options: dict[str, Any], queue: str) -> Celery:
    # The embedded set-up's control plane names its SQLite broker (sqlite://) at registration.
    sqlite_broker.register()
    app = Celery(f"gpuworker-{worker_name}", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        broker_transport_options=transport_options,
        task_default_queue=queue,
        # JSON only: a pickled message could run code in the daemon.
        accept_content=["json"],
        task_serializer="json",
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_enable_remote_control=False,
        worker_send_task_events=False,
    )
    return app


# How long the daemon waits for its consumer's warm shutdown (controlplane/launcher.py's stop grace
# for the daemon counts it).
CONSUMER_STOP_S = 10.0


class CeleryConsumer:
    """A Celery worker (solo pool) consuming exactly `queue`, in a thread of the daemon."""

    def __init__(self, app: Celery, *, worker_name: str, queue: str, log_level: str = "INFO") -> None:
        self.queue = queue
        self.worker = app.WorkController(
            hostname=f"gpuworker@{worker_name}",
            pool="solo",
            concurrency=1,
            queues=[queue],
            loglevel=log_level,
            ready_callback=None,
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )
        self._thread = threading.Thread(target=self.worker.start, name="celery-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = CONSUMER_STOP_S) -> None:
        """Warm shutdown: the task in progress (never long) finishes, then the thread ends."""
        from celery.worker import state

        state.should_stop = 0
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the Celery consumer did not stop within %.0fs", timeout_s)
