"""The Responses API's store (models.StoredResponse): synchronous ORM calls, run on the gateway's
database lanes or by the sweep task. Every read is scoped to the tenant: another tenant's id is
as unknown as one never issued."""

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.gateway.models import StoredResponse

# What the store's ids look like (resp_ and hex); anything else is not looked up at all.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A background response still running; any other status is final.
RUNNING = ("queued", "in_progress")


@dataclass(frozen=True)
class BackgroundRun:
    """What another gateway process needs to run a background response again (models.StoredResponse)."""

    request: str  # the request's body as it came
    api_key_id: int
    request_id: str
    owner: str  # the gateway process that runs it


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    if not _ID.match(response_id):
        return None
    return StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id, created_at__gte=_oldest()).first()


def stored_response_save(
    *,
    tenant_id: int,
    response_id: str,
    input_items: list,
    history: list,
    response: dict,
    background: BackgroundRun | None = None,
) -> StoredResponse:
    """`background`: the response runs on after its answer ("queued"), claimed by the process
    that runs it."""
    now = timezone.now()
    run = {}
    if background is not None:
        run = {
            "background": True,
            "request": background.request,
            "api_key_id": background.api_key_id,
            "request_id": background.request_id,
            "lease_owner": background.owner,
            "lease_expires_at": _lease_end(now),
            "runs": 1,
        }
    return StoredResponse.objects.create(
        id=response_id,
        tenant_id=tenant_id,
        created_at=now,
        status=response["status"],
        input_items=input_items,
        history=history,
        response=response,
        **run,
    )


def stored_response_finish(
    *, tenant_id: int, response_id: str, history: list | None, response: dict, owner: str = ""
) -> bool:
    """A background response's end (its answer, or its failure), unless it was cancelled first;
    `owner`: only while that process still holds its claim (another may have taken it over)."""
    fields = {"status": response["status"], "response": response}
    if history is not None:
        fields["history"] = history
    rows = StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id, status__in=RUNNING)
    if owner:
        rows = rows.filter(lease_owner=owner)
    return rows.update(**fields) > 0


def stored_response_running(*, response_id: str, owner: str) -> bool:
    """Whether the background response still runs under `owner`'s claim (not cancelled, not
    finished, not taken over)."""
    return StoredResponse.objects.filter(id=response_id, status__in=RUNNING, lease_owner=owner).exists()


def stored_responses_renew(*, owner: str, now: datetime) -> int:
    """Renew `owner`'s claims on the background responses it runs."""
    return StoredResponse.objects.filter(lease_owner=owner, status__in=RUNNING).update(lease_expires_at=_lease_end(now))


def stored_responses_claim(*, owner: str, now: datetime, limit: int = 10) -> list[StoredResponse]:
    """Take over running background responses whose claim ran out (their process died), for
    `owner` to run again; one that has been run GATEWAY_BACKGROUND_RUNS times is marked failed
    instead. A claim is a conditional update on the one it replaces, so of processes racing for a
    response exactly one gets it."""
    claimed = []
    with transaction.atomic():
        expired = (
            StoredResponse.objects.select_for_update(skip_locked=True)
            .filter(background=True, status__in=RUNNING, lease_expires_at__lt=now)
            .order_by("lease_expires_at")[:limit]
        )
        for stored in list(expired):
            if stored.runs >= settings.GATEWAY_BACKGROUND_RUNS or not stored.request:
                _fail(stored, f"The response was interrupted {stored.runs} time(s) and not run again; create it again.")
                continue
            taken = StoredResponse.objects.filter(
                pk=stored.pk, status__in=RUNNING, lease_owner=stored.lease_owner, runs=stored.runs
            ).update(lease_owner=owner, lease_expires_at=_lease_end(now), runs=stored.runs + 1)
            if taken:
                stored.lease_owner, stored.runs = owner, stored.runs + 1
                claimed.append(stored)
    return claimed


def stored_response_cancel(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    """Mark a running background response cancelled (its task sees it and stops); the response
    as it now stands."""
    stored = stored_response_get(tenant_id=tenant_id, response_id=response_id)
    if stored is None or stored.status not in RUNNING:
        return stored
    response = {**stored.response, "status": "cancelled"}
    StoredResponse.objects.filter(pk=stored.pk, status__in=RUNNING).update(status="cancelled", response=response)
    return stored_response_get(tenant_id=tenant_id, response_id=response_id)


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    deleted, _ = StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id).delete()
    return deleted > 0


def stored_responses_sweep(*, now: datetime) -> int:
    """Delete responses past the retention; mark failed the background responses still running
    long after their claim ran out (no gateway process took them over)."""
    stale = now - timedelta(seconds=settings.GATEWAY_REQUEST_TIMEOUT_SECONDS + settings.GATEWAY_COLD_START_WAIT_SECONDS)
    lost = Q(lease_expires_at__lt=stale) | Q(lease_expires_at=None, created_at__lt=stale)
    for stored in StoredResponse.objects.filter(lost, status__in=RUNNING):
        _fail(stored, "The response was interrupted; create it again.")
    deleted, _ = StoredResponse.objects.filter(created_at__lt=_oldest(now)).delete()
    return deleted


def _fail(stored: StoredResponse, message: str) -> None:
    response = {**stored.response, "status": "failed", "error": {"code": "server_error", "message": message}}
    StoredResponse.objects.filter(pk=stored.pk, status__in=RUNNING).update(status="failed", response=response)


def _lease_end(now: datetime) -> datetime:
    return now + timedelta(seconds=settings.GATEWAY_BACKGROUND_LEASE_SECONDS)


def _oldest(now: datetime | None = None) -> datetime:
    """Responses created before this are past the retention (read as gone before the sweep runs)."""
    return (now or timezone.now()) - timedelta(days=settings.GATEWAY_RESPONSES_RETENTION_DAYS)
