"""Who may open which dashboard page.

Operators run the fleet and the catalog; admins may do everything operators do and also read the
reports and manage tenants, their credits and teams, and the staff; tenant members see their own
tenant's keys, usage, credits, playground and team, and nothing else (a tenant's own admins also
manage its team: `accounts.services.may_manage_team`). A page
of the wrong role answers 403; an object of another tenant answers 404 (its existence is not
revealed), which is what `tenant_of` plus a tenant-filtered query gives.
"""

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from controlplane.accounts.models import Tenant, User

OPERATOR_ROLES = (User.Role.OPERATOR, User.Role.ADMIN)
ADMIN_ROLES = (User.Role.ADMIN,)
TENANT_ROLES = (User.Role.TENANT_MEMBER,)
# Operators and admins try what they deploy; their requests are billed to the staff tenant
# (accounts.services.playground_tenant).
PLAYGROUND_ROLES = TENANT_ROLES + OPERATOR_ROLES


def has_role(user, roles) -> bool:
    return bool(user.is_authenticated and user.is_active and user.role in roles)


def role_required(*roles: str) -> Callable:
    """Login required, then 403 unless the user has one of `roles`."""

    def decorate(view: Callable) -> Callable:
        @wraps(view)
        def wrapped(request: HttpRequest, *args, **kwargs):
            if not has_role(request.user, roles):
                raise PermissionDenied("This page is not available to your role.")
            return view(request, *args, **kwargs)

        return login_required(wrapped)

    return decorate


operator_required = role_required(*OPERATOR_ROLES)
admin_required = role_required(*ADMIN_ROLES)
tenant_required = role_required(*TENANT_ROLES)
playground_required = role_required(*PLAYGROUND_ROLES)


def tenant_of(request: HttpRequest) -> Tenant:
    """The tenant whose data a tenant member's page shows: always the user's own."""
    tenant = request.user.tenant
    if tenant is None:
        raise PermissionDenied("Your account belongs to no tenant.")
    return tenant
