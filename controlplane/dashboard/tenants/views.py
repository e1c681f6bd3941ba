"""The admins' tenant pages: every tenant with its plan, balance and team size; a new tenant; and
one tenant's credits (plan allowance, balance, ledger), a credit grant, and its team."""

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from controlplane.accounts.models import Tenant
from controlplane.accounts.selectors import tenants_by_name, tenants_with_member_counts
from controlplane.accounts.services import tenant_create
from controlplane.billing.ledger import credit_entry_by_admin
from controlplane.billing.selectors import credit_balances
from controlplane.common.money import format_usd
from controlplane.dashboard.credits import credits_context
from controlplane.dashboard.forms import form_error_messages, submit
from controlplane.dashboard.htmx import fragment_or_redirect
from controlplane.dashboard.permissions import admin_required
from controlplane.dashboard.team.views import team_context
from controlplane.dashboard.tenants.forms import CreditEntryForm, TenantCreateForm


@admin_required
@require_http_methods(["GET", "POST"])
def tenants(request: HttpRequest) -> HttpResponse:
    form = TenantCreateForm(request.POST or None)
    if request.method == "POST":
        tenant = submit(form, lambda data: tenant_create(name=data["name"], plan=data["plan"], actor=request.user))
        if tenant is not None:
            messages.success(request, f"{tenant.name} created: grant it credits and invite its first admin.")
            return redirect("dashboard:tenant_detail", tenant.pk)
    rows = list(tenants_with_member_counts())
    balances = credit_balances(tenant_ids=[tenant.pk for tenant in rows])
    return render(
        request,
        "dashboard/tenants/tenants.html",
        {
            "tenants": [{"tenant": tenant, "balance": balances[tenant.pk]} for tenant in rows],
            "form": form,
        },
        status=400 if form.errors else 200,
    )


def _detail_context(request: HttpRequest, tenant: Tenant, *, grant_form=None) -> dict:
    return {**credits_context(tenant=tenant, now=timezone.now()), "grant_form": grant_form or CreditEntryForm()}


@admin_required
@require_GET
def tenant_detail(request: HttpRequest, pk: int) -> HttpResponse:
    tenant = get_object_or_404(tenants_by_name(), pk=pk)
    return render(
        request,
        "dashboard/tenants/tenant_detail.html",
        {**_detail_context(request, tenant), **team_context(request, tenant)},
    )


@admin_required
@require_POST
def tenant_credit_grant(request: HttpRequest, pk: int) -> HttpResponse:
    """A grant or an adjustment (billing.ledger.credit_entry_by_admin)."""
    tenant = get_object_or_404(tenants_by_name(), pk=pk)
    form = CreditEntryForm(request.POST)
    entry = submit(
        form,
        lambda data: credit_entry_by_admin(
            tenant=tenant,
            amount=form.signed_amount(),
            reason=data["reason"],
            actor=request.user,
            idempotency_token=data["token"],
            confirmed=data["confirm"],
        ),
    )
    to = reverse("dashboard:tenant_detail", args=[tenant.pk])
    if entry is None:
        return fragment_or_redirect(
            request,
            lambda: render(
                request, "dashboard/tenants/_credits.html", _detail_context(request, tenant, grant_form=form)
            ),
            to=to,
            errors=form_error_messages(form),
        )
    done = "Granted" if entry.amount > 0 else "Took back"
    return fragment_or_redirect(
        request,
        lambda: render(
            request, "dashboard/tenants/_credits.html", {**_detail_context(request, tenant), "granted": entry}
        ),
        to=to,
        success=f"{done} {format_usd(abs(entry.amount))} {'to' if entry.amount > 0 else 'from'} {tenant.name}.",
    )
