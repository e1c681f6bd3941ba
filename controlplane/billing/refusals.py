"""Refused requests: their counts written in batches by the gateway (`refusals_record`) and read
by the request log and the home pages (`refusal_log`, `refusal_totals`). A refusal is never
charged; a shed request (the deployment's TTFT objective could not be met) is a refusal with the
error code SHED_ERROR_CODE."""

from dataclasses import dataclass
from datetime import datetime

from django.db import transaction
from django.db.models import Q, QuerySet, Sum

from controlplane.billing.models import Refusal

# The error code of a request shed because its predicted wait exceeded the TTFT objective.
SHED_ERROR_CODE = "overloaded"
# The request log's outcomes of refused requests: any refusal, or shed ones only.
REFUSED, SHED = "refused", "shed"
REFUSAL_OUTCOMES = (REFUSED, SHED)


@dataclass(frozen=True)
class RefusalTally:
    """`count` refusals of one kind within one minute; `reason` and `request_id` are the latest's."""

    minute: datetime
    tenant_id: int | None
    api_key_id: int | None
    model_id: int | None
    endpoint: str  # the /v1 route, as /metrics labels it
    status: int
    error_code: str
    reason: str
    request_id: str
    count: int


def refusals_record(*, tallies: list[RefusalTally]) -> None:
    """Write the tallies, one row each (rows are only added: readers sum them)."""
    reason_max = Refusal._meta.get_field("reason").max_length
    code_max = Refusal._meta.get_field("error_code").max_length
    endpoint_max = Refusal._meta.get_field("endpoint").max_length
    with transaction.atomic():
        Refusal.objects.bulk_create(
            [
                Refusal(
                    minute=t.minute,
                    tenant_id=t.tenant_id,
                    api_key_id=t.api_key_id,
                    model_id=t.model_id,
                    endpoint=t.endpoint[:endpoint_max],
                    status=t.status,
                    error_code=t.error_code[:code_max],
                    reason=t.reason[:reason_max],
                    request_id=t.request_id,
                    count=t.count,
                )
                for t in tallies
            ]
        )


def refusal_outcome(refusal: Refusal) -> str:
    """A refusal tally's outcome in the request log's words: SHED or REFUSED."""
    return SHED if refusal.error_code == SHED_ERROR_CODE else REFUSED


@dataclass(frozen=True)
class RefusalTotals:
    refused: int  # every refused request, shed ones included
    shed: int


def refusal_totals(*, since: datetime, until: datetime, tenant=None) -> RefusalTotals:
    """Refused and shed requests in [since, until), of one tenant or of everyone (with those tied
    to no tenant)."""
    rows = Refusal.objects.filter(minute__gte=since, minute__lt=until)
    if tenant is not None:
        rows = rows.filter(tenant=tenant)
    totals = rows.aggregate(refused=Sum("count"), shed=Sum("count", filter=Q(error_code=SHED_ERROR_CODE)))
    return RefusalTotals(refused=totals["refused"] or 0, shed=totals["shed"] or 0)


def refusal_log(
    *, since: datetime, until: datetime, tenant=None, api_key=None, model=None, outcome: str | None = None
) -> QuerySet[Refusal]:
    """Refusal tallies in [since, until), newest first; each filter applies when given. `outcome`
    is the request log's: REFUSED or None selects every refusal, SHED the shed ones, any other
    (a served request's outcome) none."""
    if outcome not in (None, *REFUSAL_OUTCOMES):
        return Refusal.objects.none()
    rows = Refusal.objects.filter(minute__gte=since, minute__lt=until)
    for name, value in (("tenant", tenant), ("api_key", api_key), ("model", model)):
        if value is not None:
            rows = rows.filter(**{name: value})
    if outcome == SHED:
        rows = rows.filter(error_code=SHED_ERROR_CODE)
    return rows.select_related("tenant", "api_key", "model").order_by("-minute", "-id")
