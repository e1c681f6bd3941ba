"""Celery tasks for the public API: beat's sweep of stored responses (settings), and the runner of
a batch's lines through the request path (batch_lines)."""

import asyncio
import logging

from celery import shared_task
from django.utils import timezone

from controlplane.batches.services import RUN_TASK
from controlplane.gateway.batch_lines import run_batch as run_batch_slice
from controlplane.gateway.stored_responses import stored_responses_sweep

logger = logging.getLogger(__name__)


@shared_task(name="controlplane.gateway.tasks.sweep_stored_responses")
def sweep_stored_responses() -> int:
    """Delete stored responses older than GATEWAY_RESPONSES_RETENTION_DAYS."""
    deleted = stored_responses_sweep(now=timezone.now())
    if deleted:
        logger.info("%d stored response(s) past their retention deleted", deleted)
    return deleted


@shared_task(name=RUN_TASK)
def run_batch(batch_id: int) -> str:
    """One time slice of a batch's work; the slice sends the next itself."""
    return asyncio.run(run_batch_slice(batch_id))
