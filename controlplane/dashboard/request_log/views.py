"""The request log: each request's time, key, model, tokens, time to first token, latency,
outcome and cost, filtered, paged and exported as CSV; and the requests refused before they were
served (counted per minute and kind: billing.refusals), shed ones among them. The CSV holds both:
the served requests (count 1 each), then the refusal tallies under the same filters, each with
its count, HTTP status, error code, latest reason and /v1 route, at no cost. A tenant member reads their own tenant's
requests; an admin reads every tenant's, with a tenant filter. The rows come from
billing.request_log."""

import csv
from collections.abc import Iterator
from urllib.parse import urlencode

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from controlplane.accounts.models import ApiKey, Tenant
from controlplane.billing.models import Refusal, UsageRecord
from controlplane.billing.refusals import refusal_log, refusal_outcome
from controlplane.billing.reports import period_bounds
from controlplane.billing.request_log import request_log
from controlplane.dashboard.csv_export import csv_money, csv_text
from controlplane.dashboard.permissions import ADMIN_ROLES, TENANT_ROLES, has_role, role_required, tenant_of
from controlplane.dashboard.request_log.forms import RequestLogForm

PAGE_SIZE = 50
CSV_COLUMNS = (
    "time",
    "request_id",
    "tenant",
    "key",
    "key_prefix",
    "model",
    "outcome",
    "prompt_tokens",
    "completion_tokens",
    "images",
    "time_to_first_token_ms",
    "total_latency_ms",
    "cost",
    "count",  # requests the row stands for: 1 for a served one, a refusal tally's count
    "status",  # a refusal's HTTP status
    "error_code",
    "reason",  # a refusal tally's latest reason
    "endpoint",  # a refusal's /v1 route ("/v1/files/{file_id}"), blank for an unknown path
)

request_log_required = role_required(*TENANT_ROLES, *ADMIN_ROLES)


def _own_tenant(request: HttpRequest) -> Tenant | None:
    """A tenant member's own tenant, the only one they may read; None for an admin (any tenant)."""
    return tenant_of(request) if has_role(request.user, TENANT_ROLES) else None


def _records(form: RequestLogForm, own: Tenant | None):
    since, until = period_bounds(*form.period)
    tenant = own if own is not None else form.cleaned_data["tenant"]
    return request_log(since=since, until=until, tenant=tenant, **form.filters())


def _refusals(form: RequestLogForm, own: Tenant | None):
    since, until = period_bounds(*form.period)
    tenant = own if own is not None else form.cleaned_data["tenant"]
    return refusal_log(since=since, until=until, tenant=tenant, **form.filters())


@request_log_required
@require_GET
def requests_log(request: HttpRequest) -> HttpResponse:
    own = _own_tenant(request)
    form = RequestLogForm.from_query(request.GET, tenant=own)
    context: dict = {"form": form, "all_tenants": own is None}
    if form.is_valid():
        page = Paginator(_records(form, own), PAGE_SIZE).get_page(request.GET.get("page"))
        refused = Paginator(_refusals(form, own), PAGE_SIZE).get_page(request.GET.get("refused_page"))
        context.update({"valid": True, "page": page, "refused": refused, "query": urlencode(form.data)})
    return render(request, "dashboard/request_log/requests.html", context)


@request_log_required
@require_GET
def requests_csv(request: HttpRequest) -> HttpResponse:
    own = _own_tenant(request)
    form = RequestLogForm.from_query(request.GET, tenant=own)
    if not form.is_valid():
        return render(
            request, "dashboard/request_log/requests.html", {"form": form, "all_tenants": own is None}, status=400
        )
    start, end = form.period
    # Streamed: a year of a busy tenant's requests is too many rows to hold in memory.
    lines = _csv_lines(_records(form, own), _refusals(form, own))
    response = StreamingHttpResponse(lines, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="gpuserve-requests-{start}-to-{end}.csv"'
    return response


class _Line:
    """csv.writer's file: hands back each written line."""

    def write(self, line: str) -> str:
        return line


def _csv_lines(records, refusals) -> Iterator[str]:
    writer = csv.writer(_Line())
    yield writer.writerow(CSV_COLUMNS)
    for record in records.iterator(chunk_size=2000):
        yield writer.writerow(_csv_row(record))
    for refusal in refusals.iterator(chunk_size=2000):
        yield writer.writerow(_refusal_csv_row(refusal))


def key_label(api_key: ApiKey | None) -> str:
    if api_key is None:
        return ""
    return "Playground" if api_key.purpose == ApiKey.Purpose.PLAYGROUND else api_key.name


def _csv_row(record: UsageRecord) -> tuple:
    key = record.api_key
    return (
        record.created_at.isoformat(),
        record.request_id,
        csv_text(record.tenant.name),
        csv_text(key_label(key)),
        key.prefix if key else "",
        csv_text(record.model.public_name),
        record.outcome,
        record.prompt_tokens,
        record.completion_tokens,
        record.image_count,
        "" if record.time_to_first_token_ms is None else record.time_to_first_token_ms,
        record.total_latency_ms,
        csv_money(record.price_charged),
        1,
        "",
        record.error_code,
        "",
        "",
    )


def _refusal_csv_row(refusal: Refusal) -> tuple:
    key = refusal.api_key
    return (
        refusal.minute.isoformat(),
        refusal.request_id,
        csv_text(refusal.tenant.name) if refusal.tenant else "",
        csv_text(key_label(key)),
        key.prefix if key else "",
        csv_text(refusal.model.public_name) if refusal.model else "",
        refusal_outcome(refusal),
        0,
        0,
        0,
        "",
        "",
        csv_money(0),
        refusal.count,
        refusal.status,
        csv_text(refusal.error_code),
        csv_text(refusal.reason),
        refusal.endpoint,
    )
