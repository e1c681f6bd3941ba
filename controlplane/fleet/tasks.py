"""Celery tasks for the fleet; each looks its inputs up and calls a service."""

from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.fleet.services import workers_mark_stale


@shared_task(name="controlplane.fleet.tasks.mark_stale_workers")
def mark_stale_workers() -> int:
    """Run by beat: workers that stopped sending heartbeats go offline, so nothing routes to them."""
    return workers_mark_stale(
        now=timezone.now(),
        timeout=timedelta(seconds=settings.FLEET_WORKER_HEARTBEAT_TIMEOUT_SECONDS),
    )
