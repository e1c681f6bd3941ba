"""One money format on every page: amounts to the cent, per-request prices to six significant
digits, both written by `common.money.format_usd` through the `money` template filters; no
template writes a dollar sign or rounds money itself."""

import re
from decimal import Decimal
from pathlib import Path

import pytest
from django.conf import settings
from django.template import Context, Template
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.billing.services import credit_debit, credit_grant
from controlplane.common.money import format_usd
from tests.controlplane.factories import (
    ApiKeyFactory,
    DeploymentFactory,
    ModelFactory,
    PlanFactory,
    PriceTierFactory,
    ReplicaFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)

TEMPLATES = Path(settings.BASE_DIR) / "templates"
# Figures that are not money, and may be rounded by floatformat.
NOT_MONEY = re.compile(r"(gpu_hours|gpu_busy_hours|gpu_time_s|utilisation_pct|requests_per_s|perplexity)\|floatformat")
# What format_usd writes: a sign, thousands separators, the cents, and beyond them only digits
# that matter (no trailing zero).
MONEY = re.compile(r"^-?\$\d{1,3}(,\d{3})*\.\d\d(\d{0,4}(?<!0))?$")
SHOWN_MONEY = re.compile(r"-?\$[\d,]+(\.\d+)?")


@pytest.mark.parametrize(
    ("amount", "significant", "shown"),
    [
        ("0", None, "$0.00"),
        ("25.000001", None, "$25.00"),
        ("4.996", None, "$5.00"),
        ("12.345", None, "$12.35"),  # half up
        ("1234567.891", None, "$1,234,567.89"),
        ("-7.5", None, "-$7.50"),
        ("0.004", None, "$0.004"),  # under a cent: its digits, not "$0.00"
        ("-0.000001", None, "-$0.000001"),
        ("0.002", 6, "$0.002"),
        ("1.2345678", 6, "$1.23457"),
        ("4.996", 6, "$4.996"),
        ("3", 6, "$3.00"),
        ("123456.78", 6, "$123,456.78"),  # never less than the cents
    ],
)
def test_format_usd(amount, significant, shown):
    assert format_usd(Decimal(amount), significant=significant) == shown
    assert MONEY.match(shown)


def test_the_filters_write_money_through_format_usd():
    rendered = Template(
        "{% load money %}{{ a|usd }} {{ p|usd_price }} {{ c|cost }} {{ z|cost }} {{ n|usd }} {{ l|money_input }}"
    ).render(
        Context({"a": Decimal("4.996"), "p": Decimal("0.002500"), "c": Decimal("0.0025"), "z": 0, "n": None, "l": 5})
    )
    assert rendered == "$5.00 $0.0025 $0.0025 included in plan  5"


def test_no_template_writes_a_dollar_sign_or_rounds_money_itself():
    offenders = []
    for path in sorted(TEMPLATES.rglob("*.html")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "${{" in line or (
                "floatformat" in line and len(re.findall("floatformat", line)) != len(NOT_MONEY.findall(line))
            ):
                offenders.append(f"{path.relative_to(TEMPLATES)}:{number}: {line.strip()[:120]}")
    assert offenders == []


@pytest.mark.django_db
def test_every_page_shows_money_in_the_one_format(client):
    tier = PriceTierFactory(price_per_request=Decimal("0.0025"), name="Small")
    model = ModelFactory(public_name="chat", price_tier=tier)
    replica = ReplicaFactory(deployment=DeploymentFactory(model=model))
    tenant = TenantFactory(name="Acme", plan=PlanFactory(included_requests_per_month=1))
    member = UserFactory(tenant=tenant, tenant_role=User.TenantRole.ADMIN)
    key = ApiKeyFactory(tenant=tenant, monthly_spend_limit=Decimal("12.5"))
    credit_grant(tenant=tenant, amount=Decimal("1234.567891"), memo="Welcome")
    credit_debit(tenant=tenant, amount=Decimal("0.3"), memo="Correction")
    for status in ("completed", "completed", "completed", "failed"):
        usage_record_settled(tenant=tenant, model=model, api_key=key, replica=replica, gpu_time_s=2.5, status=status)
    admin = UserFactory(role=User.Role.ADMIN, tenant=None)
    pages = {
        member: ["home", "credits", "usage", "keys", "requests"],
        admin: ["home", "reports", "tenants", "requests", "catalog"],
    }
    seen = []
    for user, names in pages.items():
        client.force_login(user)
        urls = [reverse(f"dashboard:{name}") for name in names]
        if user is admin:
            urls.append(reverse("dashboard:tenant_detail", args=[tenant.pk]))
        for url in urls:
            response = client.get(url)
            assert response.status_code == 200, url
            text = re.sub(r"<script.*?</script>", "", response.content.decode(), flags=re.S)
            for shown in SHOWN_MONEY.finditer(text):
                seen.append((url, shown.group()))
    wrong = [(url, shown) for url, shown in seen if not MONEY.match(shown)]
    assert wrong == []
    shown = {money for _, money in seen}
    # The balance to the cent, a price and a charge to their digits, the adjustment, the key's
    # limit, and the month's spend (0.005) to the cent.
    assert {"$1,234.26", "$0.0025", "-$0.0025", "-$0.30", "$12.50", "$0.01"} <= shown
