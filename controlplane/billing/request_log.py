"""The request log: usage records, newest first, filtered by tenant, key, model, outcome and a
range of time, for the dashboard's request log page and its CSV export."""

from datetime import datetime

from django.db.models import Q, QuerySet

from controlplane.billing.models import UsageRecord
from controlplane.billing.refusals import REFUSAL_OUTCOMES

# The outcomes a reader filters by, and the records each one means.
OUTCOMES = {
    "ok": Q(status=UsageRecord.Status.COMPLETED),
    "error": Q(status=UsageRecord.Status.FAILED),
    "client_gone": Q(status=UsageRecord.Status.CANCELLED),
}


def request_log(
    *, since: datetime, until: datetime, tenant=None, api_key=None, model=None, outcome: str | None = None
) -> QuerySet[UsageRecord]:
    """Records that ended in [since, until), newest first; each filter applies when given."""
    if outcome in REFUSAL_OUTCOMES:  # refused requests have no usage records (billing.refusals)
        return UsageRecord.objects.none()
    if outcome is not None and outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join((*OUTCOMES, *REFUSAL_OUTCOMES))}, got {outcome!r}")
    records = UsageRecord.objects.filter(created_at__gte=since, created_at__lt=until)
    if tenant is not None:
        records = records.filter(tenant=tenant)
    if api_key is not None:
        records = records.filter(api_key=api_key)
    if model is not None:
        records = records.filter(model=model)
    if outcome is not None:
        records = records.filter(OUTCOMES[outcome])
    return records.select_related("tenant", "api_key", "model").order_by("-created_at", "-id")
