"""The tenant's Credits page (plan, allowance left, balance, grants and charges), and the usage page
saying "included in plan" where the allowance paid instead of a bare $0."""

from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.billing.services import credit_debit, credit_grant
from tests.controlplane.factories import (
    ModelFactory,
    PlanFactory,
    PriceTierFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenant():
    return TenantFactory(name="Acme", plan=PlanFactory(name="Starter", included_requests_per_month=2))


@pytest.fixture
def member(client, tenant):
    user = UserFactory(tenant=tenant)
    client.force_login(user)
    return user


def _model():
    return ModelFactory(public_name="llama-8b", price_tier=PriceTierFactory(price_per_request=Decimal("0.004")))


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_the_credits_page_is_the_tenants_only(client, role):
    client.force_login(UserFactory(role=role, tenant=None))
    assert client.get(reverse("dashboard:credits")).status_code == 403


def test_credits_page_shows_plan_allowance_balance_grants_and_charges(client, tenant, member):
    admin = UserFactory(username="root", role=User.Role.ADMIN, tenant=None)
    credit_grant(tenant=tenant, amount=Decimal("5"), memo="Welcome credit", created_by=admin)
    model = _model()
    for _ in range(3):  # two included in the plan, the third charged
        usage_record_settled(tenant=tenant, model=model, at=timezone.now())
    other = TenantFactory()
    credit_grant(tenant=other, amount=Decimal("9"), memo="Theirs")
    page = client.get(reverse("dashboard:credits")).content.decode()
    assert 'data-testid="credits-plan">Starter<' in page
    assert 'data-testid="credits-allowance-left">0 of 2<' in page
    assert 'data-testid="credits-balance">$5.00<' in page
    assert "Welcome credit" in page and "+$5.00" in page and "Theirs" not in page
    assert "llama-8b" in page and "-$0.004" in page
    assert "root" not in page  # who granted is for admins' eyes


def test_a_new_tenant_sees_its_whole_allowance_and_no_grants(client, member):
    page = client.get(reverse("dashboard:credits")).content.decode()
    assert 'data-testid="credits-allowance-left">2 of 2<' in page
    assert 'data-testid="credit-grants-empty"' in page and 'data-testid="credits-balance">$0.00<' in page


def test_usage_says_included_in_plan_instead_of_zero(client, tenant, member):
    model = _model()
    usage_record_settled(tenant=tenant, model=model, at=timezone.now())
    page = client.get(reverse("dashboard:usage")).content.decode()
    assert 'data-testid="usage-spend">Included in plan<' in page
    assert "1 of the plan's 2 included requests left" in page and "included in plan</span>" in page


def test_usage_shows_money_once_the_allowance_is_spent(client, tenant, member):
    credit_grant(tenant=tenant, amount=Decimal("1"))
    model = _model()
    for _ in range(3):
        usage_record_settled(tenant=tenant, model=model, at=timezone.now())
    page = client.get(reverse("dashboard:usage")).content.decode()
    assert 'data-testid="usage-spend">$0.004<' in page and "0 of the plan's 2 included requests left" in page


def test_the_tenant_sees_every_grant_and_adjustment(client, tenant, member):
    for number in range(1, 31):
        credit_grant(tenant=tenant, amount=Decimal(number), memo=f"grant {number}")
    credit_debit(tenant=tenant, amount=Decimal("0.5"), memo="taken back")
    page = client.get(reverse("dashboard:credits")).content.decode()
    assert page.count('data-testid="credit-grant"') == 31
    assert "grant 1<" in page and "taken back" in page and "-$0.50" in page
