"""The admin, logged in as the seeded admin, shows every registered model and the seeded objects."""

from decimal import Decimal

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.http import HttpRequest
from django.urls import reverse

from controlplane.accounts.models import ApiKey, Tenant, User
from controlplane.billing.models import CreditEntry, Plan, PriceTier
from controlplane.catalog.models import Deployment, Model
from controlplane.env import read_env_file

pytestmark = pytest.mark.django_db

SEEDED = [Tenant, User, ApiKey, PriceTier, Plan, CreditEntry, Model, Deployment]


@pytest.fixture
def admin_client_seeded(client, tmp_path):
    env_file = tmp_path / ".env.demo"
    call_command("seed_demo", env_file=env_file, stdout=open("/dev/null", "w"))
    demo = read_env_file(env_file)
    # django-axes (login throttling) needs the request an authentication comes with.
    assert client.login(
        request=HttpRequest(), username=demo["DEMO_ADMIN_USERNAME"], password=demo["DEMO_ADMIN_PASSWORD"]
    )
    return client


def _admin_url(model, view, *args):
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


def test_every_registered_changelist_answers(admin_client_seeded):
    for model in admin.site._registry:
        response = admin_client_seeded.get(_admin_url(model, "changelist"))
        assert response.status_code == 200, model


@pytest.mark.parametrize("model", SEEDED, ids=lambda m: m.__name__)
def test_seeded_objects_are_listed_and_open(admin_client_seeded, model):
    objects = list(model.objects.all())
    assert objects, f"seed_demo created no {model.__name__}"
    listing = admin_client_seeded.get(_admin_url(model, "changelist"))
    assert listing.status_code == 200
    for obj in objects:
        assert _admin_url(model, "change", obj.pk) in listing.content.decode()
        assert admin_client_seeded.get(_admin_url(model, "change", obj.pk)).status_code == 200


def test_the_api_key_page_never_shows_the_key(admin_client_seeded, tmp_path):
    plaintext = read_env_file(tmp_path / ".env.demo")["OPENAI_API_KEY"]
    key = ApiKey.objects.get()
    for url in (_admin_url(ApiKey, "changelist"), _admin_url(ApiKey, "change", key.pk)):
        page = admin_client_seeded.get(url).content.decode()
        assert key.prefix in page and plaintext not in page


def test_admin_refuses_non_staff(client):
    user = User.objects.create_user(username="op", password="violet-harbour-7-lantern", role=User.Role.OPERATOR)
    client.force_login(user)
    response = client.get(reverse("admin:index"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_prices_are_edited_and_listed_in_dollars(admin_client_seeded):
    """Amounts are micro-units in the database; the admin reads and writes them as dollars."""
    tier = PriceTier.objects.first()
    form = admin_client_seeded.get(_admin_url(PriceTier, "change", tier.pk)).content.decode()
    assert f'value="{tier.price_per_request}"' in form and 'step="0.000001"' in form
    response = admin_client_seeded.post(
        _admin_url(PriceTier, "change", tier.pk),
        {"name": tier.name, "price_per_request": "0.333333", "reference_price_per_million_tokens": "1.5"},
    )
    assert response.status_code == 302, response.content.decode()
    tier.refresh_from_db()
    assert (tier.price_per_request, tier.reference_price_per_million_tokens) == (Decimal("0.333333"), Decimal("1.5"))
    assert "0.333333" in admin_client_seeded.get(_admin_url(PriceTier, "changelist")).content.decode()
    refused = admin_client_seeded.post(
        _admin_url(PriceTier, "change", tier.pk),
        {"name": tier.name, "price_per_request": "0.0000001", "reference_price_per_million_tokens": "1.5"},
    )
    assert refused.status_code == 200 and "decimal places" in refused.content.decode()
