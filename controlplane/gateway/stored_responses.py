"""The Responses API's store (models.StoredResponse): synchronous ORM calls, run on the gateway's
database lanes or by the sweep task. Every read is scoped to the tenant: another tenant's id is
as unknown as one never issued."""

import json
import re
from datetime import datetime, timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.gateway.models import StoredResponse

# What the store's ids look like (resp_ and hex); anything else is not looked up at all.
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def stored_response_get(*, tenant_id: int, response_id: str) -> StoredResponse | None:
    if not _ID.match(response_id):
        return None
    return StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id, created_at__gte=_oldest()).first()


def stored_response_save(
    *, tenant_id: int, response_id: str, input_items: list, history: list, response: dict
) -> StoredResponse:
    return StoredResponse.objects.create(
        id=response_id,
        tenant_id=tenant_id,
        created_at=timezone.now(),
        input_items_json=json.dumps(input_items),
        history_json=json.dumps(history),
        response_json=json.dumps(response),
    )


def stored_response_delete(*, tenant_id: int, response_id: str) -> bool:
    deleted, _ = StoredResponse.objects.filter(tenant_id=tenant_id, id=response_id).delete()
    return deleted > 0


def stored_responses_sweep(*, now: datetime) -> int:
    deleted, _ = StoredResponse.objects.filter(created_at__lt=_oldest(now)).delete()
    return deleted


def _oldest(now: datetime | None = None) -> datetime:
    """Responses created before this are past the retention (read as gone before the sweep runs)."""
    return (now or timezone.now()) - timedelta(days=settings.GATEWAY_RESPONSES_RETENTION_DAYS)
