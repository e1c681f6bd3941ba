"""Tenant pages: API keys, usage, credits, the playground. Views gather what the templates
show and call services; every query is filtered by the signed-in member's own tenant."""

from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.accounts.selectors import api_keys_for_tenant, api_keys_usable_for_tenant
from controlplane.accounts.services import api_key_create, api_key_revoke, api_key_set_spend_limit, api_key_update
from controlplane.batches.selectors import batches_list
from controlplane.billing.key_spend import api_keys_with_spend
from controlplane.billing.refusals import refusal_totals
from controlplane.billing.reports import (
    UsageRow,
    allowance_this_month,
    period_bounds,
    usage_by,
    usage_daily,
    usage_month_summary,
)
from controlplane.catalog.selectors import models_for_playground
from controlplane.dashboard.credits import credits_context
from controlplane.dashboard.forms import form_error_messages, submit
from controlplane.dashboard.htmx import fragment_or_redirect
from controlplane.dashboard.permissions import playground_required, tenant_of, tenant_required
from controlplane.dashboard.reports.forms import PeriodForm
from controlplane.dashboard.tenant.forms import ApiKeyBudgetForm, ApiKeyCreateForm, ApiKeySettingsForm
from controlplane.dashboard.tenant.playground import MAX_TOKENS_LIMIT, PlaygroundForm
from controlplane.dashboard.tenant.playground_code import code_samples
from controlplane.dashboard.tenant.quickstart import quickstart_context
from controlplane.fleet.selectors import first_ready_chat_model


def _keys(request: HttpRequest):
    """The member's tenant's keys, each with its spend this month (for its budget)."""
    return api_keys_with_spend(keys=api_keys_for_tenant(tenant=tenant_of(request)), at=timezone.now())


def _api_base_url(request: HttpRequest) -> str:
    return request.build_absolute_uri("/v1")


def _keys_context(request: HttpRequest, form: ApiKeyCreateForm, created=None) -> dict:
    context = {"keys": _keys(request), "form": form, "created": created, "now": timezone.now()}
    if created is not None:  # the first requests, with the whole key this once
        context["quickstart"] = quickstart_context(
            base_url=_api_base_url(request), api_key=created.api_key, plaintext=created.plaintext
        )
    return context


@tenant_required
@require_http_methods(["GET", "POST"])
def keys(request: HttpRequest) -> HttpResponse:
    """The key list and the create form. A created key's plaintext is in this one response only
    (never stored, never cached): the page shows it once."""
    created = None
    if request.method == "POST":
        form = ApiKeyCreateForm(request.POST)
        created = submit(
            form,
            lambda data: api_key_create(tenant=tenant_of(request), created_by=request.user, **form.service_arguments()),
        )
        if created is not None:
            form = ApiKeyCreateForm()
    else:
        form = ApiKeyCreateForm()
    context = _keys_context(request, form, created)
    template = "dashboard/tenant/_keys_create.html" if request.htmx else "dashboard/tenant/keys.html"
    response = render(request, template, context)
    if created is not None:
        response["Cache-Control"] = "no-store"
    return response


@tenant_required
@require_POST
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    api_key = get_object_or_404(_keys(request), pk=key_id)
    if not api_key.revoked:
        api_key = api_key_revoke(api_key=api_key, actor=request.user)
    if request.htmx:
        return render(request, "dashboard/tenant/_key_row.html", {"key": api_key, "now": timezone.now()})
    return render(request, "dashboard/tenant/keys.html", _keys_context(request, ApiKeyCreateForm()))


@tenant_required
@require_POST
def key_budget(request: HttpRequest, key_id: int) -> HttpResponse:
    """Set or clear a key's monthly spend limit; htmx gets the key's row back, with the error
    beside the field when the amount is refused."""
    api_key = get_object_or_404(_keys(request), pk=key_id)
    form = ApiKeyBudgetForm(request.POST)
    saved = submit(
        form,
        lambda data: api_key_set_spend_limit(
            api_key=api_key, monthly_spend_limit=data["monthly_spend_limit"], actor=request.user
        ),
    )
    return fragment_or_redirect(
        request,
        lambda: render(
            request, "dashboard/tenant/_key_row.html", {"key": api_key, "now": timezone.now(), "budget_form": form}
        ),
        to=reverse("dashboard:keys"),
        success=f"The monthly spend limit of “{api_key.name}” is saved." if saved else "",
        errors=form_error_messages(form),
    )


@tenant_required
@require_http_methods(["GET", "POST"])
def key_edit(request: HttpRequest, key_id: int) -> HttpResponse:
    """Edit a key's name, models and limits; its secret stays. Another tenant's key, a playground
    session's or an unknown one: 404."""
    api_key = get_object_or_404(_keys(request), pk=key_id)
    form = ApiKeySettingsForm.for_key(api_key, request.POST if request.method == "POST" else None)
    if request.method == "POST":
        saved = submit(
            form, lambda data: api_key_update(api_key=api_key, actor=request.user, **form.service_arguments())
        )
        if saved is not None:
            messages.success(request, f"The key “{saved.name}” is saved.")
            return redirect("dashboard:keys")
    return render(request, "dashboard/tenant/key_edit.html", {"key": api_key, "form": form})


@tenant_required
@require_GET
def quickstart(request: HttpRequest) -> HttpResponse:
    """The API's base URL and first requests, for the key chosen (?key=) or the newest usable one."""
    usable = api_keys_usable_for_tenant(tenant=tenant_of(request))
    chosen = request.GET.get("key", "")
    api_key = next((k for k in usable if str(k.pk) == chosen), usable[0] if usable else None)
    context = {"usable_keys": usable, **quickstart_context(base_url=_api_base_url(request), api_key=api_key)}
    template = "dashboard/tenant/_quickstart_samples.html" if request.htmx else "dashboard/tenant/quickstart.html"
    return render(request, template, context)


@tenant_required
@require_GET
def usage(request: HttpRequest) -> HttpResponse:
    tenant = tenant_of(request)
    now = timezone.now()
    summary = usage_month_summary(tenant=tenant, now=now)
    # The chart's axis spans the whole month, so it reads as a month even on the 1st, but its
    # lines stop at today: days still to come have no figures, not zeros.
    month_end = (summary.since + timedelta(days=32)).replace(day=1).date() - timedelta(days=1)
    days = usage_daily(start=summary.since.date(), end=now.date(), tenant=tenant)
    chart = {
        "days": [row.key for row in days],
        "span": [summary.since.date().isoformat(), month_end.isoformat()],
        "series": [
            {"label": "Spend ($)", "scale": "$", "values": [float(row.revenue) for row in days]},
            {"label": "Requests", "scale": "requests", "values": [row.requests for row in days]},
        ],
    }
    context = {
        "summary": summary,
        "days": days,
        "chart": chart,
        "has_usage": summary.totals.requests > 0,
        "allowance": allowance_this_month(tenant=tenant, now=now),
        "refused": refusal_totals(since=summary.since, until=now, tenant=tenant),
        "period_form": (period_form := PeriodForm.from_query(request.GET)),
    }  # the last 30 days
    if period_form.is_valid():
        since, until = period_bounds(*period_form.period)
        context["groups"] = [
            _usage_group(label, usage_by(group_by=group_by, since=since, until=until, tenant=tenant))
            for label, group_by in (("By model", "model"), ("By key", "key"))
        ]
    return render(request, "dashboard/tenant/usage.html", context)


@dataclass(frozen=True)
class UsageGroup:
    """One breakdown of the usage page's period (by model or by key): its rows and their bar chart."""

    title: str
    id: str
    rows: list[UsageRow]
    chart: dict


def _usage_group(title: str, rows: list[UsageRow]) -> UsageGroup:
    # Requests, not spend: the plan's included requests cost nothing but are traffic all the same.
    return UsageGroup(
        title,
        title.lower().replace(" ", "-"),
        rows,
        {"labels": [r.key for r in rows], "series": [{"label": "Requests", "values": [r.requests for r in rows]}]},
    )


@tenant_required
@require_GET
def credits(request: HttpRequest) -> HttpResponse:
    """The plan, what is left of its allowance this month, the balance and recent grants and charges."""
    return render(
        request, "dashboard/tenant/credits.html", credits_context(tenant=tenant_of(request), now=timezone.now())
    )


@tenant_required
@require_GET
def batches(request: HttpRequest) -> HttpResponse:
    """The tenant's batches, newest first, with their progress; the table refreshes itself (htmx)
    while any of them is still running."""
    rows = batches_list(tenant_id=tenant_of(request).pk, limit=50)
    running = any(batch.status not in batch.ENDED for batch in rows)
    template = "dashboard/tenant/_batch_table.html" if request.htmx else "dashboard/tenant/batches.html"
    return render(request, template, {"batches": rows, "running": running})


@playground_required
@require_GET
def playground(request: HttpRequest) -> HttpResponse:
    offered = list(models_for_playground())
    default = first_ready_chat_model(models=offered)
    form = PlaygroundForm(
        initial={"temperature": 0.7, "top_p": 1.0, "max_tokens": 128, "model": default.public_name if default else None}
    )
    models = [{"public_name": m.public_name, "context_length": m.served_context_length} for m in offered]
    return render(
        request,
        "dashboard/tenant/playground.html",
        {
            "form": form,
            "models": models,
            "max_tokens_limit": MAX_TOKENS_LIMIT,
            "vision_models": form.vision_models(),
            # Operators and admins belong to no tenant: the page names the one that pays.
            "staff_tenant": settings.PLAYGROUND_STAFF_TENANT if request.user.tenant_id is None else "",
        },
    )


@playground_required
@require_GET
def playground_code(request: HttpRequest) -> HttpResponse:
    """The "view code" panel for the playground form's current values (sent by htmx as a GET)."""
    prompt = PlaygroundForm(request.GET).prompt_so_far()
    base_url = request.build_absolute_uri("/v1")
    return render(
        request, "dashboard/tenant/_playground_code.html", {"samples": code_samples(base_url=base_url, prompt=prompt)}
    )
