"""The Responses API's store (models.StoredResponse): synchronous ORM calls, run on the gateway's
database lanes or by the sweep task. Every read is scoped to the tenant: another tenant's id is
as unknown as one never issued."""

import re
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.gateway.models import StoredResponse

# What the store's ids look like (resp_ and hex); anything else is not looked up at all.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A background response still running; any other status is final.
RUNNING = ("queued", "in_progress")


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    if not _ID.match(response_id):
        return None
    return StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id, created_at__gte=_oldest()).first()


def stored_response_save(
    *, tenant_id: int, response_id: str, input_items: list, history: list, response: dict, background: bool = False
) -> StoredResponse:
    return StoredResponse.objects.create(
        id=response_id,
        tenant_id=tenant_id,
        created_at=timezone.now(),
        background=background,
        status=response["status"],
        input_items=input_items,
        history=history,
        response=response,
    )


def stored_response_finish(*, tenant_id: int, response_id: str, history: list | None, response: dict) -> bool:
    """A background response's end (its answer, or its failure), unless it was cancelled first."""
    fields = {"status": response["status"], "response": response}
    if history is not None:
        fields["history"] = history
    rows = StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id, status__in=RUNNING)
    return rows.update(**fields) > 0


def stored_response_cancel(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    """Mark a running background response cancelled (its task sees it and stops); the response
    as it now stands."""
    stored = stored_response_get(tenant_id=tenant_id, response_id=response_id)
    if stored is None or stored.status not in RUNNING:
        return stored
    response = {**stored.response, "status": "cancelled"}
    StoredResponse.objects.filter(pk=stored.pk, status__in=RUNNING).update(status="cancelled", response=response)
    return stored_response_get(tenant_id=tenant_id, response_id=response_id)


def stored_response_status(*, response_id: str) -> str | None:
    return StoredResponse.objects.filter(id=response_id).values_list("status", flat=True).first()


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    deleted, _ = StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id).delete()
    return deleted > 0


def stored_responses_sweep(*, now: datetime) -> int:
    """Delete responses past the retention; mark failed the background responses still running
    long after any request may (their gateway process stopped under them)."""
    stale = now - timedelta(seconds=settings.GATEWAY_REQUEST_TIMEOUT_SECONDS + settings.GATEWAY_COLD_START_WAIT_SECONDS)
    for stored in StoredResponse.objects.filter(status__in=RUNNING, created_at__lt=stale):
        error = {"code": "server_error", "message": "The response was interrupted; create it again."}
        response = {**stored.response, "status": "failed", "error": error}
        StoredResponse.objects.filter(pk=stored.pk, status__in=RUNNING).update(status="failed", response=response)
    deleted, _ = StoredResponse.objects.filter(created_at__lt=_oldest(now)).delete()
    return deleted


def _oldest(now: datetime | None = None) -> datetime:
    """Responses created before this are past the retention (read as gone before the sweep runs)."""
    return (now or timezone.now()) - timedelta(days=settings.GATEWAY_RESPONSES_RETENTION_DAYS)
