"""The home page: one section per role the user has, each with its real figures."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.billing.services import credit_grant
from controlplane.fleet.models import Replica
from tests.controlplane.factories import (
    ApiKeyFactory,
    DeploymentFactory,
    GpuFactory,
    ModelFactory,
    PlanFactory,
    PriceTierFactory,
    ReplicaFactory,
    TenantFactory,
    UserFactory,
    usage_record_settled,
)
from tests.controlplane.fleet.conftest import make_worker

pytestmark = pytest.mark.django_db


def _page(client, user) -> str:
    client.force_login(user)
    response = client.get(reverse("dashboard:home"))
    assert response.status_code == 200
    return response.content.decode()


def _sections(page: str) -> set[str]:
    return {name for name in ("operator", "tenant", "admin") if f'id="home-{name}"' in page}


@pytest.mark.parametrize(
    ("role", "sections"),
    [
        (User.Role.OPERATOR, {"operator"}),
        (User.Role.TENANT_MEMBER, {"tenant"}),
        # Admins may do all an operator does: they see both sections.
        (User.Role.ADMIN, {"operator", "admin"}),
    ],
)
def test_each_role_sees_its_sections(client, role, sections):
    user = UserFactory(role=role, tenant=TenantFactory() if role == User.Role.TENANT_MEMBER else None)
    assert _sections(_page(client, user)) == sections


def test_tenant_section_shows_spend_allowance_today_latency_and_usable_keys(client):
    tenant = TenantFactory(plan=PlanFactory(included_requests_per_month=3))
    credit_grant(tenant=tenant, amount=Decimal("5"))
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=Decimal("0.25")))
    now = timezone.now()
    for latency in (100, 200, 300, 400):  # 3 included, the 4th charged
        usage_record_settled(
            tenant=tenant,
            model=model,
            at=now - timedelta(seconds=1),
            total_latency_ms=latency,
            time_to_first_token_ms=latency // 4,
        )
    usage_record_settled(
        tenant=TenantFactory(plan=PlanFactory(included_requests_per_month=9)),
        model=model,
        at=now,
        total_latency_ms=9000,
    )  # another tenant's
    ApiKeyFactory(tenant=tenant, name="production", last_used_at=now)
    ApiKeyFactory(tenant=tenant, name="revoked", revoked=True)
    ApiKeyFactory(tenant=tenant, name="expired", expires_at=now - timedelta(days=1))

    page = _page(client, UserFactory(role=User.Role.TENANT_MEMBER, tenant=tenant))
    assert 'id="home-spend">$0.25<' in page
    assert 'id="home-allowance-left">0<' in page and "of 3 this month" in page
    assert 'id="home-requests-today">4<' in page
    assert 'id="home-latency">200 / 400 ms<' in page and "first token 50 / 100 ms" in page
    assert 'id="home-keys-count">1 usable<' in page and "production" in page
    assert "revoked" not in page and "expired" not in page


def test_tenant_without_traffic_or_keys_is_told_where_to_start(client):
    page = _page(client, UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory(plan=None)))
    assert 'id="home-allowance-left">—<' in page and 'id="home-latency">—<' in page
    assert 'id="home-no-keys"' in page and reverse("dashboard:keys") in page


def test_operator_section_shows_fleet_health_errors_and_models_not_ready(client):
    worker = make_worker()
    gpu = GpuFactory(worker=worker, index=0)
    GpuFactory(worker=worker, index=1)
    serving = DeploymentFactory()
    ReplicaFactory(deployment=serving, worker=worker, gpu=gpu, state=Replica.State.READY, endpoint_url="http://w:1")
    waiting = DeploymentFactory(model=ModelFactory(public_name="needs-room"), desired_replicas=2)
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    usage_record_settled(tenant=tenant, model=serving.model, status="failed")
    usage_record_settled(tenant=tenant, model=serving.model)

    page = _page(client, UserFactory(role=User.Role.OPERATOR, tenant=None))
    assert 'id="home-workers-online">1<' in page
    assert 'id="home-gpus-busy">1 / 2<' in page
    assert 'id="home-errors">1<' in page and "of 2 requests" in page
    assert 'data-model="needs-room"' in page and f'data-model="{serving.model.public_name}"' not in page
    assert waiting.model.public_name in page


def test_operator_section_survives_unreadable_request_counters(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    page = _page(client, UserFactory(role=User.Role.OPERATOR, tenant=None))
    assert 'id="home-requests-per-s">—<' in page and "unreadable" in page


def test_admin_section_shows_revenue_gpu_hours_margin_and_top_tenants(client, settings):
    settings.GPU_HOUR_COST_USD = Decimal("3")
    model = ModelFactory(public_name="paid", price_tier=PriceTierFactory(price_per_request=Decimal("2")))
    replica = ReplicaFactory(
        deployment=DeploymentFactory(model=model),
        gpu=GpuFactory(),
        state=Replica.State.READY,
        endpoint_url="http://w:1",
    )
    # Placed two hours ago (or at the month's start, if that is later): that share counts.
    now = timezone.now()
    placed = max(now - timedelta(hours=2), now.replace(day=1, hour=0, minute=0, second=0, microsecond=0))
    Replica.objects.filter(pk=replica.pk).update(created_at=placed)
    big, small = TenantFactory(name="Big"), TenantFactory(name="Small")
    for tenant, count in ((big, 3), (small, 1)):
        credit_grant(tenant=tenant, amount=Decimal("10"))
        for _ in range(count):
            usage_record_settled(tenant=tenant, model=model, at=now - timedelta(seconds=1))

    page = _page(client, UserFactory(role=User.Role.ADMIN, tenant=None))
    assert 'id="home-revenue">$8.00<' in page
    hours = (now - placed).total_seconds() / 3600
    assert f'id="home-gpu-hours">{hours:.2f}<' in page or f'id="home-gpu-hours">{hours + 0.01:.2f}<' in page
    assert 'data-model="paid"' in page
    assert page.index('data-tenant="Big"') < page.index('data-tenant="Small"')
