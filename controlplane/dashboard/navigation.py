"""The dashboard's navigation: one list of sections, each shown only to the roles it serves.

A context processor resolves the entries for the signed-in user, so every page's menu is the same
and a link never points at a page its reader would get a 403 from.
"""

from dataclasses import dataclass

from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse

from controlplane.dashboard.permissions import ADMIN_ROLES, OPERATOR_ROLES, PLAYGROUND_ROLES, TENANT_ROLES, has_role


@dataclass(frozen=True)
class NavItem:
    label: str
    url_name: str
    roles: tuple[str, ...]


NAV_ITEMS = (
    NavItem("Fleet", "dashboard:fleet", OPERATOR_ROLES),
    NavItem("Catalog", "dashboard:catalog", OPERATOR_ROLES),
    NavItem("Audit log", "dashboard:audit", OPERATOR_ROLES),
    NavItem("Quickstart", "dashboard:quickstart", TENANT_ROLES),
    NavItem("API keys", "dashboard:keys", TENANT_ROLES),
    NavItem("Usage", "dashboard:usage", TENANT_ROLES),
    NavItem("Requests", "dashboard:requests", TENANT_ROLES + ADMIN_ROLES),
    NavItem("Credits", "dashboard:credits", TENANT_ROLES),
    NavItem("Batches", "dashboard:batches", TENANT_ROLES),
    NavItem("Playground", "dashboard:playground", PLAYGROUND_ROLES),
    NavItem("Team", "dashboard:team", TENANT_ROLES),
    NavItem("Reports", "dashboard:reports", ADMIN_ROLES),
    NavItem("Tenants", "dashboard:tenants", ADMIN_ROLES),
    NavItem("Staff", "dashboard:staff", ADMIN_ROLES),
)


def nav(request: HttpRequest) -> dict:
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"nav_items": []}
    items = []
    for item in NAV_ITEMS:
        if not has_role(user, item.roles):
            continue
        try:
            url = reverse(item.url_name)
        except NoReverseMatch:  # a section whose pages this build does not serve
            continue
        items.append({"label": item.label, "url": url, "active": request.path.startswith(url)})
    return {"nav_items": items}
