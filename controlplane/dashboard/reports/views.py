"""Admin reports: requests, revenue and GPU time by tenant, model or day over a range, the
per-token comparison, and the same rows as CSV. The figures come from billing.reports."""

import csv
from urllib.parse import urlencode

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from controlplane.billing.reports import UsageRow, period_bounds, usage_by, usage_daily, usage_totals
from controlplane.dashboard.csv_export import csv_money, csv_text
from controlplane.dashboard.permissions import admin_required
from controlplane.dashboard.reports.forms import ReportForm

CSV_COLUMNS = (
    "requests",
    "failed",
    "revenue",
    "reference",
    "difference",
    "gpu_time_s",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
)


@admin_required
@require_GET
def reports(request: HttpRequest) -> HttpResponse:
    form = ReportForm.from_query(request.GET)
    context: dict = {"form": form}
    if form.is_valid():
        start, end = form.period
        since, until = period_bounds(start, end)
        group_by = form.cleaned_data["group_by"]
        rows = usage_by(group_by=group_by, since=since, until=until)
        daily = usage_daily(start=start, end=end)
        context.update(
            {
                "valid": True,
                "rows": rows,
                "totals": usage_totals(since=since, until=until),
                "group_by": group_by,
                "start": start,
                "end": end,
                "query": urlencode(form.data),
                # Money and requests in charts of their own; the per-token reference, often a small
                # fraction of the flat price, on an axis of its own so that its line is not flat.
                "daily_chart": {
                    "days": [r.key for r in daily],
                    "series": [
                        {"label": "Revenue ($)", "scale": "$", "values": [float(r.revenue) for r in daily]},
                        {
                            "label": "Per-token reference ($)",
                            "scale": "$reference",
                            "values": [float(r.reference) for r in daily],
                        },
                    ],
                },
                "requests_chart": {
                    "days": [r.key for r in daily],
                    "series": [
                        {"label": "Requests", "scale": "requests", "values": [r.requests for r in daily]},
                        {"label": "Failed", "scale": "requests", "values": [r.failed for r in daily]},
                    ],
                },
                "group_chart": None
                if group_by == "day"
                else {
                    "labels": [r.key for r in rows],
                    "series": [
                        {"label": "Revenue ($)", "scale": "$", "values": [float(r.revenue) for r in rows]},
                        {
                            "label": "Per-token reference ($)",
                            "scale": "$reference",
                            "values": [float(r.reference) for r in rows],
                        },
                    ],
                },
            }
        )
    return render(request, "dashboard/reports/reports.html", context)


@admin_required
@require_GET
def reports_csv(request: HttpRequest) -> HttpResponse:
    form = ReportForm.from_query(request.GET)
    if not form.is_valid():
        return render(request, "dashboard/reports/reports.html", {"form": form}, status=400)
    start, end = form.period
    since, until = period_bounds(start, end)
    group_by = form.cleaned_data["group_by"]
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="gpuserve-{group_by}-{start}-to-{end}.csv"'
    writer = csv.writer(response)
    writer.writerow((group_by, *CSV_COLUMNS))
    for row in usage_by(group_by=group_by, since=since, until=until):
        writer.writerow(_csv_row(row))
    return response


def _csv_row(row: UsageRow) -> tuple:
    return (
        csv_text(row.key),
        row.requests,
        row.failed,
        csv_money(row.revenue),
        csv_money(row.reference),
        csv_money(row.difference),
        f"{row.gpu_time_s:.3f}",
        row.prompt_tokens,
        row.cached_prompt_tokens,
        row.completion_tokens,
    )
