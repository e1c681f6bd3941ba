"""Celery tasks of the gateway: running a batch's lines through the request path (batch_lines)."""

import asyncio

from celery import shared_task

from controlplane.batches.services import RUN_TASK
from controlplane.gateway.batch_lines import run_batch as run_batch_slice


@shared_task(name=RUN_TASK)
def run_batch(batch_id: int) -> str:
    """One time slice of a batch's work; the slice sends the next itself."""
    return asyncio.run(run_batch_slice(batch_id))
