"""Team pages: a tenant's members and invitations (its admins manage them, platform admins manage
every tenant's), the staff's invitations (admins), and accepting an invitation link.

Who may change what is decided by the services (`accounts.services.may_manage_team`): a member
who is not a tenant admin gets their 403 from there. Another tenant's objects answer 404.
"""

from django.contrib import messages
from django.contrib.auth import login
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from django_htmx.http import HttpResponseClientRedirect

from controlplane.accounts.models import Tenant, User
from controlplane.accounts.selectors import (
    invitation_get_by_token,
    invitations_of,
    invitations_open,
    staff_members,
    team_members,
    tenants_by_name,
)
from controlplane.accounts.services import (
    invitation_accept,
    invitation_create,
    invitation_revoke,
    may_manage_team,
    member_remove,
    member_set_tenant_role,
)
from controlplane.dashboard.forms import form_error_messages, submit
from controlplane.dashboard.htmx import fragment_or_redirect
from controlplane.dashboard.permissions import admin_required, role_required, tenant_of, tenant_required
from controlplane.dashboard.team.forms import (
    InvitationAcceptForm,
    MemberRoleForm,
    StaffInvitationForm,
    TeamInvitationForm,
)

team_managers_required = role_required(User.Role.ADMIN, User.Role.TENANT_MEMBER)


def invitation_link(request: HttpRequest, token: str) -> str:
    return request.build_absolute_uri(reverse("dashboard:invitation_accept", args=[token]))


def team_context(request: HttpRequest, tenant: Tenant, *, invite_form=None, created=None, team_error: str = "") -> dict:
    """What the team section (`dashboard/team/_team.html`) shows, on the team page and on an admin's
    tenant page alike. `created` is a just-made invitation, whose link is in this response only."""
    return {
        "tenant": tenant,
        "members": team_members(tenant=tenant),
        "invitations": invitations_open(tenant=tenant),
        "can_manage": may_manage_team(user=request.user, tenant=tenant),
        "invite_form": invite_form or TeamInvitationForm(),
        "role_choices": User.TenantRole.choices,
        "created": created,
        "invite_link": invitation_link(request, created.token) if created else "",
        "team_error": team_error,
    }


def _team_page(request: HttpRequest, tenant: Tenant) -> str:
    if request.user.role == User.Role.ADMIN:
        return reverse("dashboard:tenant_detail", args=[tenant.pk])
    return reverse("dashboard:team")


def _tenant_for(request: HttpRequest, tenant_id: int) -> Tenant:
    """The tenant a team action addresses: any for admins, only their own for tenant members."""
    if request.user.role == User.Role.ADMIN:
        return get_object_or_404(tenants_by_name(), pk=tenant_id)
    if request.user.tenant_id != tenant_id:
        raise Http404("No such tenant.")
    return tenant_of(request)


def _team_answer(request: HttpRequest, tenant: Tenant, *, success: str = "", error: str = "") -> HttpResponse:
    return fragment_or_redirect(
        request,
        lambda: render(request, "dashboard/team/_team.html", team_context(request, tenant, team_error=error)),
        to=_team_page(request, tenant),
        success=success,
        errors=[error] if error else [],
    )


@tenant_required
@require_GET
def team(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/team/team.html", team_context(request, tenant_of(request)))


@team_managers_required
@require_POST
def team_invitation_create(request: HttpRequest, tenant_id: int) -> HttpResponse:
    tenant = _tenant_for(request, tenant_id)
    form = TeamInvitationForm(request.POST)
    created = submit(
        form,
        lambda data: invitation_create(
            created_by=request.user,
            role=User.Role.TENANT_MEMBER,
            tenant=tenant,
            tenant_role=data["tenant_role"],
            note=data["note"],
        ),
    )
    context = team_context(request, tenant, invite_form=None if created else form, created=created)
    if request.htmx:
        response = render(request, "dashboard/team/_team.html", context)
    elif created is None:
        for text in form_error_messages(form):
            messages.error(request, text)
        return redirect(_team_page(request, tenant))
    else:  # a plain post: the link can be shown only now, so on a page of its own
        response = render(
            request, "dashboard/team/invitation_created.html", {**context, "back": _team_page(request, tenant)}
        )
    if created is not None:
        response["Cache-Control"] = "no-store"
    return response


@team_managers_required
@require_POST
def team_invitation_revoke(request: HttpRequest, tenant_id: int, pk: int) -> HttpResponse:
    tenant = _tenant_for(request, tenant_id)
    invitation = get_object_or_404(invitations_of(tenant=tenant), pk=pk)
    try:
        invitation_revoke(invitation=invitation, actor=request.user)
    except ValidationError as exc:
        return _team_answer(request, tenant, error=" ".join(exc.messages))
    return _team_answer(request, tenant, success="Invitation withdrawn: its link no longer works.")


@team_managers_required
@require_POST
def member_role(request: HttpRequest, tenant_id: int, pk: int) -> HttpResponse:
    tenant = _tenant_for(request, tenant_id)
    member = get_object_or_404(team_members(tenant=tenant), pk=pk)
    form = MemberRoleForm(request.POST)
    changed = submit(
        form, lambda data: member_set_tenant_role(member=member, tenant_role=data["tenant_role"], actor=request.user)
    )
    if changed is None:
        return _team_answer(request, tenant, error=" ".join(form_error_messages(form)))
    return _team_answer(request, tenant, success=f"{member.username} is now {changed.get_tenant_role_display()}.")


@team_managers_required
@require_POST
def member_remove_view(request: HttpRequest, tenant_id: int, pk: int) -> HttpResponse:
    tenant = _tenant_for(request, tenant_id)
    member = get_object_or_404(team_members(tenant=tenant), pk=pk)
    try:
        member_remove(member=member, actor=request.user)
    except ValidationError as exc:
        return _team_answer(request, tenant, error=" ".join(exc.messages))
    if member.pk == request.user.pk:  # removed themselves: signed out from the next request on
        return HttpResponseClientRedirect(reverse("login")) if request.htmx else redirect("login")
    return _team_answer(request, tenant, success=f"{member.username} was removed from {tenant.name}.")


# --- Staff (admins) ----------------------------------------------------------------------------------


def _staff_context(request: HttpRequest, *, form=None, created=None, error: str = "") -> dict:
    return {
        "staff": staff_members(),
        "invitations": invitations_open(tenant=None),
        "invite_form": form or StaffInvitationForm(),
        "created": created,
        "invite_link": invitation_link(request, created.token) if created else "",
        "staff_error": error,
    }


@admin_required
@require_http_methods(["GET", "POST"])
def staff(request: HttpRequest) -> HttpResponse:
    """Operators and admins, and invitations for new ones (the link shown once, like a key)."""
    form = created = None
    if request.method == "POST":
        form = StaffInvitationForm(request.POST)
        created = submit(
            form, lambda data: invitation_create(created_by=request.user, role=data["role"], note=data["note"])
        )
        if created is not None:
            form = None
    template = "dashboard/team/_staff.html" if request.htmx else "dashboard/team/staff.html"
    response = render(request, template, _staff_context(request, form=form, created=created))
    if created is not None:
        response["Cache-Control"] = "no-store"
    return response


@admin_required
@require_POST
def staff_invitation_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    invitation = get_object_or_404(invitations_of(tenant=None), pk=pk)
    error = ""
    try:
        invitation_revoke(invitation=invitation, actor=request.user)
    except ValidationError as exc:
        error = " ".join(exc.messages)
    return fragment_or_redirect(
        request,
        lambda: render(request, "dashboard/team/_staff.html", _staff_context(request, error=error)),
        to=reverse("dashboard:staff"),
        success="" if error else "Invitation withdrawn: its link no longer works.",
        errors=[error] if error else [],
    )


# --- Accepting an invitation (no login) ------------------------------------------------------------


@require_http_methods(["GET", "POST"])
def invitation_accept_view(request: HttpRequest, token: str) -> HttpResponse:
    invitation = invitation_get_by_token(token=token)
    refusal = "This invitation link is not valid." if invitation is None else invitation.refusal()
    if refusal:
        return render(
            request,
            "dashboard/team/invitation_accept.html",
            {"refusal": refusal},
            status=404 if invitation is None else 410,
        )
    form = InvitationAcceptForm(request.POST or None)
    if request.method == "POST":
        user = submit(
            form,
            lambda data: invitation_accept(
                token=token, username=data["username"], password=data["password"], email=data["email"]
            ),
        )
        if user is not None:
            login(request, user, backend="django.contrib.auth.backends.ModelBackend")
            messages.success(request, f"Welcome, {user.username}: your login is ready.")
            return redirect("dashboard:home")
    response = render(request, "dashboard/team/invitation_accept.html", {"invitation": invitation, "form": form})
    response["Cache-Control"] = "no-store"
    return response
