"""Celery tasks for the public API; beat runs them periodically (settings)."""

import logging

from celery import shared_task
from django.utils import timezone

from controlplane.gateway.stored_responses import stored_responses_sweep

logger = logging.getLogger(__name__)


@shared_task(name="controlplane.gateway.tasks.sweep_stored_responses")
def sweep_stored_responses() -> int:
    """Delete stored responses older than GATEWAY_RESPONSES_RETENTION_DAYS."""
    deleted = stored_responses_sweep(now=timezone.now())
    if deleted:
        logger.info("%d stored response(s) past their retention deleted", deleted)
    return deleted
