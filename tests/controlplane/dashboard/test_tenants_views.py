"""The admins' tenant pages: the list, a new tenant, and granting credits (audited, exact, shown to
the tenant); every other role gets 403."""

from decimal import Decimal

import pytest
from django.urls import reverse

from controlplane.accounts.models import Tenant, User
from controlplane.audit.models import AuditEntry
from controlplane.billing.models import CreditEntry
from controlplane.billing.selectors import credit_balance
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import PlanFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(client):
    user = UserFactory(username="root", role=User.Role.ADMIN, tenant=None)
    client.force_login(user)
    return user


def _pages(tenant) -> list[tuple[str, str]]:
    return [
        ("get", reverse("dashboard:tenants")),
        ("post", reverse("dashboard:tenants")),
        ("get", reverse("dashboard:tenant_detail", args=[tenant.pk])),
        ("post", reverse("dashboard:tenant_credit_grant", args=[tenant.pk])),
        ("get", reverse("dashboard:staff")),
    ]


@pytest.mark.parametrize("who", ["operator", "member", "tenant_admin"])
def test_other_roles_get_403_and_change_nothing(client, who):
    tenant = TenantFactory()
    user = {
        "operator": lambda: UserFactory(role=User.Role.OPERATOR, tenant=None),
        "member": lambda: UserFactory(tenant=tenant),
        "tenant_admin": lambda: UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN),
    }[who]()
    client.force_login(user)
    for method, url in _pages(tenant):
        response = getattr(client, method)(url, {"amount": "5", "note": "free money", "name": "New"})
        assert response.status_code == 403, (method, url)
    assert credit_balance(tenant=tenant) == 0 and not Tenant.objects.filter(name="New").exists()


def test_anonymous_visitors_are_sent_to_login(client):
    response = client.get(reverse("dashboard:tenants"))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


def test_the_list_shows_each_tenant_with_plan_members_and_balance(client, admin):
    acme = TenantFactory(name="Acme", plan=PlanFactory(name="Starter"))
    UserFactory(tenant=acme)
    UserFactory(tenant=acme, is_active=False)  # removed: not counted
    credit_grant(tenant=acme, amount=Decimal("12.5"))
    TenantFactory(name="Empty")
    page = client.get(reverse("dashboard:tenants")).content.decode()
    row = page[page.index('data-tenant-name="Acme"') :]
    row = row[: row.index("</tr>")]
    assert "Starter" in row and '<td class="num">1</td>' in row and "$12.50" in row
    assert 'data-tenant-name="Empty"' in page


def test_an_admin_creates_a_tenant(client, admin):
    plan = PlanFactory(name="Starter")
    response = client.post(reverse("dashboard:tenants"), {"name": "  Initech ", "plan": plan.pk})
    tenant = Tenant.objects.get(name="Initech")
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:tenant_detail", args=[tenant.pk])
    assert tenant.plan == plan
    assert AuditEntry.objects.filter(action=AuditEntry.Action.TENANT_CREATE, actor=admin).exists()
    again = client.post(reverse("dashboard:tenants"), {"name": "Initech"})
    assert again.status_code == 400 and "already exists" in again.content.decode()


def test_an_admin_grants_credits_and_the_tenant_sees_them(client, admin):
    tenant = TenantFactory(name="Acme")
    response = client.post(
        reverse("dashboard:tenant_credit_grant", args=[tenant.pk]),
        {"amount": "25.000001", "note": "Pilot"},
        headers={"HX-Request": "true"},
    )
    page = response.content.decode()
    assert response.status_code == 200 and page.lstrip().startswith('<section class="card" id="tenant-credits">')
    assert 'id="grant-done"' in page and 'data-testid="credits-balance">$25.000001<' in page
    entry = CreditEntry.objects.get(tenant=tenant)
    assert (entry.kind, entry.amount, entry.memo, entry.created_by) == ("grant", Decimal("25.000001"), "Pilot", admin)
    audit = AuditEntry.objects.get(action=AuditEntry.Action.CREDIT_GRANT)
    assert audit.actor == admin and audit.detail["amount"] == "25.000001"
    client.force_login(UserFactory(tenant=tenant))
    credits = client.get(reverse("dashboard:credits")).content.decode()
    assert 'data-testid="credits-balance">$25.000001<' in credits and "Pilot" in credits


def test_a_plain_post_grant_redirects_with_a_message(client, admin):
    tenant = TenantFactory()
    response = client.post(
        reverse("dashboard:tenant_credit_grant", args=[tenant.pk]), {"amount": "3", "note": "x"}, follow=True
    )
    assert response.redirect_chain[-1][0] == reverse("dashboard:tenant_detail", args=[tenant.pk])
    assert f"Granted $3 to {tenant.name}." in response.content.decode()


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"amount": "0", "note": "x"}, "amount", "greater than or equal to 0.000001"),
        ({"amount": "-5", "note": "x"}, "amount", "greater than or equal to"),
        ({"amount": "0.0000001", "note": "x"}, "amount", "no more than 6 decimal places"),
        ({"amount": "lots", "note": "x"}, "amount", "Enter a number"),
        ({"amount": "NaN", "note": "x"}, "amount", "Enter a number"),
        ({"amount": "5", "note": "   "}, "note", "required"),
    ],
)
def test_bad_grants_are_refused_beside_their_field(client, admin, data, field, message):
    tenant = TenantFactory()
    response = client.post(
        reverse("dashboard:tenant_credit_grant", args=[tenant.pk]), data, headers={"HX-Request": "true"}
    )
    page = response.content.decode()
    start = page.index(f'id="error-{field}"')
    assert message in page[start : page.index("</div>", start)]
    assert not CreditEntry.objects.filter(tenant=tenant).exists()
    assert not AuditEntry.objects.filter(action=AuditEntry.Action.CREDIT_GRANT).exists()


def test_an_unknown_tenant_is_404(client, admin):
    assert client.get(reverse("dashboard:tenant_detail", args=[999999])).status_code == 404
    assert (
        client.post(reverse("dashboard:tenant_credit_grant", args=[999999]), {"amount": "1", "note": "x"}).status_code
        == 404
    )
