"""Celery tasks for batches; each calls a service. The runner of a batch's lines is
`controlplane.gateway.tasks.run_batch` (it sends them through the gateway's request path)."""

import logging

from celery import shared_task
from django.utils import timezone

from controlplane.batches.services import RESUME_TASK, batches_resume

logger = logging.getLogger(__name__)


@shared_task(name=RESUME_TASK)
def resume_batches() -> int:
    """Beat: send every batch without a live runner to one (a dead runner's batch goes on)."""
    ids = batches_resume(now=timezone.now())
    if ids:
        logger.info("sent %d batch(es) to a runner", len(ids))
    return len(ids)
