"""The tenant's Batches page (each batch with its progress, refreshing itself while one runs) and
the request log's mark on batch requests."""

import json
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.batches.models import Batch
from controlplane.batches.services import batch_create, batch_file_create, batch_line_hold, batch_line_settle
from controlplane.billing.holds import RequestOutcome
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ModelFactory, PriceTierFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def storage_dir(settings, tmp_path):
    settings.BATCH_STORAGE_DIR = str(tmp_path)


def _batch(tenant, lines: int = 4) -> Batch:
    from controlplane.batches.services import batch_validate

    raw = b"".join(
        json.dumps(
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    file = batch_file_create(tenant_id=tenant.pk, filename="in.jsonl", purpose="batch", chunks=[raw])
    batch = batch_create(
        tenant_id=tenant.pk,
        api_key_id=None,
        input_file=file,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        now=timezone.now(),
    )
    return batch_validate(batch_id=batch.pk, now=timezone.now())


def test_the_page_lists_the_tenants_batches_with_progress(client):
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    client.force_login(UserFactory(tenant=tenant))
    model = ModelFactory(public_name="tiny", price_tier=PriceTierFactory(price_per_request=Decimal("0.004")))
    batch = _batch(tenant)
    line = batch.lines.first()
    batch_line_hold(
        line=line, tenant_id=tenant.pk, api_key_id=None, model_id=model.pk, price=Decimal("0.002"), now=timezone.now()
    )
    batch_line_settle(
        line_id=line.pk,
        outcome=RequestOutcome(line.request_id, "completed", batch=True),
        status_code=200,
        response={},
        error=None,
        now=timezone.now(),
    )
    theirs = _batch(TenantFactory())
    page = client.get(reverse("dashboard:batches")).content.decode()
    assert batch.public_id in page and theirs.public_id not in page
    assert 'value="25"' in page and "in_progress" in page
    assert 'hx-trigger="every 3s"' in page  # refreshes while running
    fragment = client.get(reverse("dashboard:batches"), headers={"HX-Request": "true"}).content.decode()
    assert fragment.startswith('<div id="batch-table"') and "<html" not in fragment
    log = client.get(reverse("dashboard:requests")).content.decode()
    assert ">batch</span>" in log


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_the_batches_page_is_the_tenants_only(client, role):
    client.force_login(UserFactory(role=role, tenant=None))
    assert client.get(reverse("dashboard:batches")).status_code == 403
