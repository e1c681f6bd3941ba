"""The API keys page: roles, tenant isolation, a created key shown once, revoking, field errors."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.keys import hash_api_key
from controlplane.accounts.models import ApiKey, User
from controlplane.accounts.selectors import ApiKeyRejected, api_key_authenticate
from controlplane.accounts.services import playground_key_create
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, PriceTierFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db

TENANT_PAGES = ("dashboard:keys", "dashboard:usage", "dashboard:playground")


@pytest.fixture
def member(client):
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory(name="Acme"))
    client.force_login(user)
    return user


@pytest.mark.parametrize("page", TENANT_PAGES)
def test_anonymous_visitors_are_sent_to_login(client, page):
    response = client.get(reverse(page))
    assert response.status_code == 302 and response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("page", [page for page in TENANT_PAGES if page != "dashboard:playground"])
@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_tenant_pages_are_forbidden_to_other_roles(client, page, role):
    # The playground is theirs too (billed to the staff tenant): test_playground_parts.py.
    client.force_login(UserFactory(role=role, tenant=None))
    assert client.get(reverse(page)).status_code == 403


@pytest.mark.parametrize("page", TENANT_PAGES)
def test_tenant_pages_open_for_members(client, member, page):
    assert client.get(reverse(page)).status_code == 200


def test_empty_key_list_says_what_to_do(client, member):
    page = client.get(reverse("dashboard:keys")).content.decode()
    assert 'id="key-empty"' in page and "No API keys yet" in page


def test_created_key_is_shown_once_and_works(client, member):
    response = client.post(reverse("dashboard:keys"), {"name": "production"})
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    page = response.content.decode()
    start = page.index('id="key-plaintext"')
    plaintext = page[page.index(">", start) + 1 : page.index("</code>", start)]
    assert plaintext.startswith("sk-") and "this is the only time it is shown" in page
    api_key = api_key_authenticate(plaintext=plaintext)
    assert api_key.tenant == member.tenant and api_key.name == "production" and api_key.created_by == member
    assert api_key.key_hash == hash_api_key(plaintext)
    # Never again: the list shows the prefix only.
    listing = client.get(reverse("dashboard:keys")).content.decode()
    assert plaintext not in listing and api_key.prefix in listing and 'id="key-plaintext"' not in listing


def test_htmx_create_returns_the_panel_and_refreshes_the_list(client, member):
    response = client.post(reverse("dashboard:keys"), {"name": "ci"}, headers={"HX-Request": "true"})
    page = response.content.decode()
    assert page.lstrip().startswith('<section class="card" id="key-create">')
    assert 'id="key-list" hx-swap-oob="true"' in page and 'data-key-name="ci"' in page
    assert "<html" not in page


def test_create_with_limits_expiry_and_models(client, member):
    model = ModelFactory(price_tier=PriceTierFactory(), context_length=256, parameter_count=1, gpu_memory_bytes=1)
    expires = (timezone.now() + timedelta(days=7)).replace(second=0, microsecond=0)
    client.post(
        reverse("dashboard:keys"),
        {
            "name": "batch",
            "expires_at": expires.strftime("%Y-%m-%dT%H:%M"),
            "allowed_models": [model.public_name],
            "rate_limit_per_minute": "30",
            "max_concurrent_requests": "2",
            "batch_priority": "on",
        },
    )
    api_key = ApiKey.objects.get(name="batch")
    assert api_key.batch_priority
    assert api_key.expires_at == expires and not api_key.all_models
    assert list(api_key.allowed_models.all()) == [model]
    assert (api_key.rate_limit_per_minute, api_key.max_concurrent_requests) == (30, 2)


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"name": "taken"}, "name", "already has a key with this name"),
        ({"name": "k", "expires_at": "2001-01-01T00:00"}, "expires_at", "must be in the future"),
        ({"name": "k", "expires_at": "next tuesday"}, "expires_at", "Enter a valid date/time"),
        ({"name": "   "}, "name", "This field is required"),
        ({"name": "k", "rate_limit_per_minute": "0"}, "rate_limit_per_minute", "greater than or equal to 1"),
        ({"name": "k", "allowed_models": ["no-such-model"]}, "allowed_models", "Select a valid choice"),
    ],
)
def test_bad_input_gets_an_error_beside_its_field(client, member, data, field, message):
    ApiKeyFactory(tenant=member.tenant, name="taken")
    response = client.post(reverse("dashboard:keys"), data)
    page = response.content.decode()
    start = page.index(f'id="error-{field}"')
    beside = page[start : page.index("</div>", start)]
    assert message in beside and "hidden" not in beside.split(">")[0]
    assert ApiKey.objects.filter(tenant=member.tenant).count() == 1


def test_a_tenant_sees_only_its_own_keys(client, member):
    own = ApiKeyFactory(tenant=member.tenant, name="mine")
    other = ApiKeyFactory(tenant=TenantFactory(), name="theirs")
    page = client.get(reverse("dashboard:keys")).content.decode()
    assert f'id="key-{own.pk}"' in page and f'id="key-{other.pk}"' not in page and "theirs" not in page


def test_playground_session_keys_are_not_listed(client, member):
    session = playground_key_create(user=member)
    assert session.api_key.purpose == ApiKey.Purpose.PLAYGROUND and session.api_key.expires_at > timezone.now()
    page = client.get(reverse("dashboard:keys")).content.decode()
    assert session.api_key.prefix not in page and 'id="key-empty"' in page


def test_revoke_with_htmx_returns_the_revoked_row(client, member):
    api_key = ApiKeyFactory(tenant=member.tenant)
    response = client.post(reverse("dashboard:key_revoke", args=[api_key.pk]), headers={"HX-Request": "true"})
    row = response.content.decode()
    assert row.lstrip().startswith(f'<tr id="key-{api_key.pk}"') and 'data-state="revoked"' in row
    assert 'data-testid="key-revoke"' not in row
    api_key.refresh_from_db()
    assert api_key.revoked
    with pytest.raises(ApiKeyRejected, match="revoked"):
        api_key_authenticate(plaintext=api_key.plaintext)


def test_revoke_is_a_post_with_confirmation(client, member):
    api_key = ApiKeyFactory(tenant=member.tenant, name="prod")
    page = client.get(reverse("dashboard:keys")).content.decode()
    assert 'hx-confirm="Revoke the key “prod”?' in page
    assert client.get(reverse("dashboard:key_revoke", args=[api_key.pk])).status_code == 405


def test_another_tenants_key_is_not_found(client, member):
    other = ApiKeyFactory(tenant=TenantFactory())
    assert client.post(reverse("dashboard:key_revoke", args=[other.pk])).status_code == 404
    other.refresh_from_db()
    assert not other.revoked


def test_a_playground_key_cannot_be_revoked_through_the_page(client, member):
    session = playground_key_create(user=member)
    assert client.post(reverse("dashboard:key_revoke", args=[session.api_key.pk])).status_code == 404


def test_a_key_is_created_with_a_monthly_spend_limit(client, member):
    client.post(reverse("dashboard:keys"), {"name": "capped", "monthly_spend_limit": "12.50"})
    assert ApiKey.objects.get(name="capped").monthly_spend_limit == Decimal("12.50")
    response = client.post(reverse("dashboard:keys"), {"name": "bad", "monthly_spend_limit": "-1"})
    assert response.context["form"].errors["monthly_spend_limit"] and not ApiKey.objects.filter(name="bad").exists()


def test_a_keys_limit_is_set_changed_and_cleared_from_its_row_with_this_months_spend(client, member):
    from controlplane.billing.services import credit_grant
    from tests.controlplane.factories import usage_record_settled

    api_key = ApiKeyFactory(tenant=member.tenant, name="production")
    credit_grant(tenant=member.tenant, amount=Decimal("1"))
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=Decimal("0.25")))
    usage_record_settled(tenant=member.tenant, model=model, api_key=api_key)
    usage_record_settled(
        tenant=member.tenant, model=model, api_key=api_key, at=timezone.now() - timedelta(days=40)
    )  # an earlier month: not this month's spend
    url = reverse("dashboard:key_budget", args=[api_key.pk])
    row = client.post(url, {"monthly_spend_limit": "5"}, headers={"HX-Request": "true"}).content.decode()
    assert row.startswith(f'<tr id="key-{api_key.pk}"')
    assert 'data-testid="key-spent">$0.25<' in row and 'data-testid="key-limit"> of $5.00<' in row
    api_key.refresh_from_db()
    assert api_key.monthly_spend_limit == Decimal("5")

    row = client.post(url, {"monthly_spend_limit": "-2"}, headers={"HX-Request": "true"}).content.decode()
    assert 'data-testid="key-budget-error">' in row and "greater than or equal to 0" in row and 'value="-2"' in row
    api_key.refresh_from_db()
    assert api_key.monthly_spend_limit == Decimal("5")

    response = client.post(url, {"monthly_spend_limit": ""})  # no JavaScript: back to the page
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:keys")
    api_key.refresh_from_db()
    assert api_key.monthly_spend_limit is None
    assert "is saved" in client.get(reverse("dashboard:keys")).content.decode()


def test_another_tenants_key_limit_cannot_be_set(client, member):
    theirs = ApiKeyFactory(tenant=TenantFactory())
    response = client.post(reverse("dashboard:key_budget", args=[theirs.pk]), {"monthly_spend_limit": "1"})
    assert response.status_code == 404
    theirs.refresh_from_db()
    assert theirs.monthly_spend_limit is None


def test_a_key_used_moments_ago_reads_just_now(client, member):
    now = timezone.now()
    ApiKeyFactory(tenant=member.tenant, name="fresh", last_used_at=now - timedelta(seconds=20))
    ApiKeyFactory(tenant=member.tenant, name="older", last_used_at=now - timedelta(minutes=5, seconds=10))
    ApiKeyFactory(tenant=member.tenant, name="unused", last_used_at=None)
    page = client.get(reverse("dashboard:keys")).content.decode().replace("\xa0", " ")

    def row(name: str) -> str:
        start = page.index(f'data-key-name="{name}"')
        return page[start : page.index("</tr>", start)]

    assert "just now" in row("fresh") and "0 minutes" not in page
    assert "5 minutes ago" in row("older")
    assert "Never" in row("unused")
