"""The fleet's Celery messages: the worker contract's tasks to a daemon's own queue, and reconcile
requests to the control plane's workers. Each is sent once the transaction that decided it commits,
so a rolled-back decision never goes out."""

import logging
from typing import Any

from django.db import transaction

from controlplane.celery import app as celery_app
from gpuworker.contract.tasks import WorkerTask

logger = logging.getLogger(__name__)

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


def send_to_worker(*, queue: str, task: WorkerTask) -> None:
    """A task of the worker contract to the daemon consuming `queue`."""
    _send_after_commit(task.NAME, queue=queue, kwargs=task.as_kwargs())


def request_reconcile(*, deployment_ids: list[int] | None = None) -> None:
    """Reconcile these deployments (all when None) soon, on a control-plane Celery worker."""
    ids = sorted(set(deployment_ids)) if deployment_ids is not None else None
    _send_after_commit(RECONCILE, kwargs={"deployment_ids": ids}, expires=_RECONCILE_EXPIRES_SECONDS)
