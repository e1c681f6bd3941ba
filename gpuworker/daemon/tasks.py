"""The daemon's Celery side: its app (broker settings from registration), the three control tasks,
and their argument checks. A task with bad arguments is rejected with a logged reason and no
retry; a good one only hands a command to the agent, so tasks never block on a model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from celery import Celery

from gpuworker.daemon.supervisor import LoadRequest

logger = logging.getLogger(__name__)

LOAD_MODEL, UNLOAD_MODEL, DRAIN_WORKER = "gpuworker.load_model", "gpuworker.unload_model", "gpuworker.drain_worker"
DTYPES = ("auto", "float32", "float16", "bfloat16")
MAX_TIMEOUT_S = 3600.0
_MISSING = object()


class TaskArgumentError(ValueError):
    pass


class TaskHandler(Protocol):
    def load(self, request: LoadRequest) -> None: ...
    def unload(self, replica_id: int, drain_timeout_s: float) -> None: ...
    def drain(self, timeout_s: float) -> None: ...


# -- argument checks: each returns the value or raises TaskArgumentError naming field and limit --

def _int_at_least(minimum: int, optional: bool = False) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise TaskArgumentError(f"{name} must be an integer >= {minimum}{' or null' if optional else ''}, "
                                    f"got {value!r}")
        return value
    return check


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 4096:
        raise TaskArgumentError(f"{name} must be a non-empty string of at most 4096 characters, got {value!r}")
    return value


def _number_in(low: float, high: float, low_open: bool = False) -> Callable[[str, Any], float]:
    def check(name: str, value: Any) -> float:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and \
            (low < value if low_open else low <= value) and value <= high
        if not ok:
            raise TaskArgumentError(f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], "
                                    f"got {value!r}")
        return float(value)
    return check


def _dtype(name: str, value: Any) -> str:
    if value not in DTYPES:
        raise TaskArgumentError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return value


# task name -> {argument: (checker, default or _MISSING when required)}
SIGNATURES: dict[str, dict[str, tuple[Callable[[str, Any], Any], Any]]] = {
    LOAD_MODEL: {
        "replica_id": (_int_at_least(0), _MISSING),
        "model_path": (_text, _MISSING),
        "served_model_name": (_text, _MISSING),
        "gpu_index": (_int_at_least(0, optional=True), _MISSING),
        "memory_fraction": (_number_in(0.0, 1.0, low_open=True), _MISSING),
        "max_model_len": (_int_at_least(1, optional=True), None),
        "dtype": (_dtype, "auto"),
    },
    UNLOAD_MODEL: {
        "replica_id": (_int_at_least(0), _MISSING),
        "drain_timeout_s": (_number_in(0.0, MAX_TIMEOUT_S), 30.0),
    },
    DRAIN_WORKER: {
        "timeout_s": (_number_in(0.0, MAX_TIMEOUT_S), 60.0),
    },
}


def check_arguments(task: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The task's arguments with defaults filled in, or TaskArgumentError saying what is wrong."""
    signature = SIGNATURES[task]
    if args:
        raise TaskArgumentError(f"takes keyword arguments only, got {len(args)} positional argument(s)")
    unknown = sorted(set(kwargs) - set(signature))
    if unknown:
        raise TaskArgumentError(f"unexpected argument(s) {', '.join(unknown)}; expected {', '.join(signature)}")
    checked = {}
    for name, (check, default) in signature.items():
        if name not in kwargs:
            if default is _MISSING:
                raise TaskArgumentError(f"{name} is required")
            checked[name] = default
        else:
            checked[name] = check(name, kwargs[name])
    return checked


def register_tasks(app: Celery, handler: TaskHandler) -> None:
    def accepted(task: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        try:
            checked = check_arguments(task, args, kwargs)
        except TaskArgumentError as exc:
            logger.error("rejected %s: %s (arguments: %r %r)", task, exc, args, kwargs)
            return None
        logger.info("accepted %s %s", task, checked)
        return checked

    @app.task(name=LOAD_MODEL)
    def load_model(*args: Any, **kwargs: Any) -> None:
        if (checked := accepted(LOAD_MODEL, args, kwargs)) is not None:
            handler.load(LoadRequest(**checked))

    @app.task(name=UNLOAD_MODEL)
    def unload_model(*args: Any, **kwargs: Any) -> None:
        if (checked := accepted(UNLOAD_MODEL, args, kwargs)) is not None:
            handler.unload(checked["replica_id"], checked["drain_timeout_s"])

    @app.task(name=DRAIN_WORKER)
    def drain_worker(*args: Any, **kwargs: Any) -> None:
        if (checked := accepted(DRAIN_WORKER, args, kwargs)) is not None:
            handler.drain(checked["timeout_s"])


def build_celery_app(*, worker_name: str, broker_url: str, transport_options: dict[str, Any],
                     queue: str) -> Celery:
    app = Celery(f"gpuworker-{worker_name}", set_as_current=False)
    app.conf.update(
        broker_url=broker_url, broker_transport_options=transport_options, task_default_queue=queue,
        # JSON only: a pickled message could run code in the daemon.
        accept_content=["json"], task_serializer="json", task_ignore_result=True,
        worker_hijack_root_logger=False, worker_redirect_stdouts=False, worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True, worker_enable_remote_control=False,
        worker_send_task_events=False,
    )
    return app


class CeleryConsumer:
    """A Celery worker (solo pool) consuming exactly `queue`, in a thread of the daemon."""

    def __init__(self, app: Celery, *, worker_name: str, queue: str, log_level: str = "INFO") -> None:
        self.queue = queue
        self.worker = app.WorkController(hostname=f"gpuworker@{worker_name}", pool="solo", concurrency=1,
                                         queues=[queue], loglevel=log_level, ready_callback=None,
                                         without_heartbeat=True, without_mingle=True, without_gossip=True)
        self._thread = threading.Thread(target=self.worker.start, name="celery-consumer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Warm shutdown: the task in progress (never long) finishes, then the thread ends."""
        from celery.worker import state

        state.should_stop = 0
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("the Celery consumer did not stop within %.0fs", timeout_s)
