"""The fleet's Celery messages: gpuworker.* tasks to a worker daemon's own queue, and reconcile
requests to the control plane's workers. Each is sent once the transaction that decided it commits,
so a rolled-back decision never goes out."""

import logging
from typing import Any

from django.db import transaction

from controlplane.celery import app as celery_app

logger = logging.getLogger(__name__)

LOAD_MODEL = "gpuworker.load_model"
UNLOAD_MODEL = "gpuworker.unload_model"
DRAIN_WORKER = "gpuworker.drain_worker"
RECONCILE = "controlplane.fleet.tasks.reconcile"
# A reconcile request older than this is superseded by the periodic one anyway.
_RECONCILE_EXPIRES_SECONDS = 60


def _send_after_commit(name: str, *, kwargs: dict[str, Any], **options: Any) -> None:
    def send() -> None:
        try:
            celery_app.send_task(name, kwargs=kwargs, **options)
        except Exception:
            # The decision is already committed; reconcile heals an unsent message (a pending
            # replica that is never acknowledged is failed and placed again).
            logger.exception("could not send %s (%s)", name, options)

    transaction.on_commit(send)


def send_load_model(
    *, queue: str, replica_id: int, model_path: str, served_model_name: str, gpu_index: int | None,
    memory_fraction: float, max_model_len: int | None,
) -> None:
    _send_after_commit(LOAD_MODEL, queue=queue, kwargs={
        "replica_id": replica_id, "model_path": model_path, "served_model_name": served_model_name,
        "gpu_index": gpu_index, "memory_fraction": memory_fraction, "max_model_len": max_model_len,
        "dtype": "auto",
    })


def send_unload_model(*, queue: str, replica_id: int, drain_timeout_s: float) -> None:
    _send_after_commit(UNLOAD_MODEL, queue=queue, kwargs={"replica_id": replica_id, "drain_timeout_s": drain_timeout_s})


def send_drain_worker(*, queue: str, timeout_s: float) -> None:
    _send_after_commit(DRAIN_WORKER, queue=queue, kwargs={"timeout_s": timeout_s})


def request_reconcile(*, deployment_ids: list[int] | None = None) -> None:
    """Reconcile these deployments (all when None) soon, on a control-plane Celery worker."""
    ids = sorted(set(deployment_ids)) if deployment_ids is not None else None
    _send_after_commit(RECONCILE, kwargs={"deployment_ids": ids}, expires=_RECONCILE_EXPIRES_SECONDS)
