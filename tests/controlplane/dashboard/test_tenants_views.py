"""The admins' tenant pages: the list, a new tenant, and granting credits (audited, exact, shown to
the tenant); every other role gets 403."""

from decimal import Decimal
from uuid import uuid4

import pytest
from django.test import override_settings
from django.urls import reverse

from controlplane.accounts.models import Tenant, User
from controlplane.audit.models import AuditEntry
from controlplane.billing.models import CreditEntry
from controlplane.billing.selectors import credit_balance
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import PlanFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


def _entry(*, amount: str, reason: str = "x", direction: str = "grant", **more) -> dict:
    """A credit entry form's post, with a fresh token unless `token` is given."""
    return {"direction": direction, "amount": amount, "reason": reason, "token": str(uuid4()), **more}


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
        response = getattr(client, method)(url, {**_entry(amount="5"), "name": "New"})
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
        _entry(amount="25.000001", reason="Pilot"),
        headers={"HX-Request": "true"},
    )
    page = response.content.decode()
    assert response.status_code == 200 and page.lstrip().startswith('<section class="card" id="tenant-credits">')
    assert 'id="grant-done"' in page and 'data-testid="credits-balance">$25.00<' in page
    entry = CreditEntry.objects.get(tenant=tenant)
    assert (entry.kind, entry.amount, entry.memo, entry.created_by) == ("grant", Decimal("25.000001"), "Pilot", admin)
    audit = AuditEntry.objects.get(action=AuditEntry.Action.CREDIT_GRANT)
    assert audit.actor == admin and audit.detail["amount"] == "25.000001"
    client.force_login(UserFactory(tenant=tenant))
    credits = client.get(reverse("dashboard:credits")).content.decode()
    assert 'data-testid="credits-balance">$25.00<' in credits and "Pilot" in credits


def test_a_plain_post_grant_redirects_with_a_message(client, admin):
    tenant = TenantFactory()
    response = client.post(
        reverse("dashboard:tenant_credit_grant", args=[tenant.pk]), _entry(amount="3", reason="x"), follow=True
    )
    assert response.redirect_chain[-1][0] == reverse("dashboard:tenant_detail", args=[tenant.pk])
    assert f"Granted $3.00 to {tenant.name}." in response.content.decode()


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        (_entry(amount="0"), "amount", "greater than or equal to 0.000001"),
        (_entry(amount="-5"), "amount", "greater than or equal to"),
        (_entry(amount="0.0000001"), "amount", "no more than 6 decimal places"),
        (_entry(amount="lots"), "amount", "Enter a number"),
        (_entry(amount="NaN"), "amount", "Enter a number"),
        (_entry(amount="5", reason="   "), "reason", "required"),
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
    assert client.post(reverse("dashboard:tenant_credit_grant", args=[999999]), _entry(amount="1")).status_code == 404


def _post_entry(client, tenant, data):
    return client.post(reverse("dashboard:tenant_credit_grant", args=[tenant.pk]), data, headers={"HX-Request": "true"})


@override_settings(CREDIT_CONFIRM_ABOVE_USD=Decimal("100"))
def test_a_large_grant_asks_for_confirmation_first(client, admin):
    tenant = TenantFactory()
    data = _entry(amount="250", reason="Enterprise pilot")
    page = _post_entry(client, tenant, data).content.decode()
    assert 'id="id_confirm"' in page and "$250.00 is above $100.00: tick the box to confirm it." in page
    assert f'value="{data["token"]}"' in page  # the same form, so confirming cannot make a second entry
    assert not CreditEntry.objects.filter(tenant=tenant).exists()
    page = _post_entry(client, tenant, {**data, "confirm": "on"}).content.decode()
    assert 'id="grant-done"' in page and "Granted $250.00 (Enterprise pilot)" in page
    assert credit_balance(tenant=tenant) == Decimal("250")


@override_settings(CREDIT_ENTRY_MAX_USD=Decimal("1000"))
def test_a_grant_over_the_bound_is_refused_beside_the_amount(client, admin):
    tenant = TenantFactory()
    page = _post_entry(client, tenant, _entry(amount="1000000000", confirm="on")).content.decode()
    start = page.index('id="error-amount"')
    assert "more than one entry may move ($1,000.00" in page[start : page.index("</div>", start)]
    assert not CreditEntry.objects.filter(tenant=tenant).exists()


def test_a_double_submit_makes_one_entry(client, admin):
    tenant = TenantFactory()
    data = _entry(amount="5", reason="Top-up")
    for _ in range(2):
        assert _post_entry(client, tenant, data).status_code == 200
    assert CreditEntry.objects.filter(tenant=tenant).count() == 1 and credit_balance(tenant=tenant) == Decimal("5")
    assert AuditEntry.objects.filter(action=AuditEntry.Action.CREDIT_GRANT).count() == 1


def test_a_fresh_form_after_an_entry_has_a_new_token(client, admin):
    tenant = TenantFactory()
    data = _entry(amount="5")
    page = _post_entry(client, tenant, data).content.decode()
    assert 'name="token"' in page and data["token"] not in page


def test_an_adjustment_takes_credits_back_and_the_tenant_sees_it(client, admin):
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("20"))
    page = _post_entry(client, tenant, _entry(amount="7.5", reason="Duplicate grant", direction="adjustment"))
    assert "Took back $7.50 (Duplicate grant)" in page.content.decode()
    entry = CreditEntry.objects.get(tenant=tenant, kind=CreditEntry.Kind.DEBIT)
    assert (entry.amount, entry.memo, entry.created_by) == (Decimal("-7.5"), "Duplicate grant", admin)
    assert AuditEntry.objects.get(action=AuditEntry.Action.CREDIT_ADJUST).actor == admin
    client.force_login(UserFactory(tenant=tenant))
    credits = client.get(reverse("dashboard:credits")).content.decode()
    row = credits[credits.index('data-kind="debit"') :]
    row = row[: row.index("</tr>")]
    assert "Adjustment" in row and "Duplicate grant" in row and "-$7.50" in row
    assert 'data-testid="credits-balance">$12.50<' in credits


def test_an_adjustment_beyond_the_balance_is_refused(client, admin):
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("2"))
    page = _post_entry(client, tenant, _entry(amount="3", direction="adjustment")).content.decode()
    start = page.index('id="error-amount"')
    assert "so at most $2.00." in page[start : page.index("</div>", start)]
    assert credit_balance(tenant=tenant) == Decimal("2")


@pytest.mark.parametrize("token", [None, "not-a-uuid"])
def test_a_form_without_its_token_is_refused_and_says_so(client, admin, token):
    tenant = TenantFactory()
    data = {key: value for key, value in _entry(amount="5").items() if key != "token"}
    page = _post_entry(client, tenant, data if token is None else {**data, "token": token}).content.decode()
    start = page.index('id="grant-form-error"')
    assert "reload the page" in page[start : page.index("</div>", start)]
    assert not CreditEntry.objects.filter(tenant=tenant).exists()
