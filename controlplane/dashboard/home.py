"""The home page's sections, one per role the signed-in user has: operators see the fleet's health,
tenant members their own tenant's spend and traffic, admins revenue against GPU cost. Every figure
is a read of the owning app's selectors; nothing here is stored or estimated.

Where the figures come from:
- fleet health, GPUs busy, models not ready: the workers, GPUs and replicas as recorded (heartbeats
  drive replica states) and the workers' latest heartbeats (GPU utilisation);
  `fleet.selectors.fleet_health`.
- requests/s: the gateways' own request counters over AUTOSCALE_RATE_WINDOW_SECONDS, the figure the
  autoscaler reads (`fleet.traffic.traffic_snapshot`).
- errors, spend, requests, latency, revenue, top tenants: usage records, one per finished request
  (`billing.reports`), and for errors and requests also the refused requests' tallies
  (`billing.refusals`, written by the gateway where it counts them for /metrics); allowance left:
  `billing.reports.allowance_this_month`, as the credits page.
- GPU-hours and margin per model: the replicas' recorded lifetimes on GPUs
  (`fleet.selectors.gpu_seconds_by_model`) at settings.GPU_HOUR_COST_USD, against flat-price
  revenue (`dashboard.margins.model_margins`).
"""

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.utils import timezone

from controlplane.accounts.models import ApiKey
from controlplane.accounts.selectors import api_keys_unrevoked_for_tenant
from controlplane.billing.refusals import RefusalTotals, refusal_totals
from controlplane.billing.reports import (
    Latency,
    UsageRow,
    allowance_this_month,
    month_start_of,
    usage_by,
    usage_latency,
    usage_month_summary,
    usage_totals,
)
from controlplane.dashboard.margins import ModelMargin, model_margins
from controlplane.dashboard.permissions import ADMIN_ROLES, OPERATOR_ROLES, TENANT_ROLES, has_role
from controlplane.fleet.selectors import FleetHealth, fleet_health
from controlplane.fleet.traffic import traffic_snapshot

logger = logging.getLogger(__name__)

ERRORS_WINDOW = timedelta(hours=1)
TOP_TENANTS = 5


@dataclass(frozen=True)
class OperatorHome:
    fleet: FleetHealth
    requests_per_s: float | None  # None: the gateways' counters could not be read
    last_hour: UsageRow  # its `failed` are the errors among the requests served
    refused_last_hour: RefusalTotals  # requests refused (shed ones among them): errors too

    @property
    def errors(self) -> int:
        return self.last_hour.failed + self.refused_last_hour.refused

    @property
    def requests(self) -> int:
        return self.last_hour.requests + self.refused_last_hour.refused


@dataclass(frozen=True)
class TenantHome:
    spend_this_month: Decimal
    balance: Decimal
    allowance_left: int | None  # None: the tenant has no plan
    included_per_month: int
    requests_today: int
    failed_today: int  # refused requests included
    shed_today: int
    latency_today: Latency
    keys: list[ApiKey]  # usable (not revoked, not expired), most recently used first

    @property
    def recent_keys(self) -> list[ApiKey]:
        return self.keys[:5]


@dataclass(frozen=True)
class AdminHome:
    since: datetime
    revenue: Decimal
    requests: int
    gpu_hour_cost: Decimal
    margins: list[ModelMargin]
    top_tenants: list[UsageRow]

    @property
    def gpu_hours(self) -> float:
        return sum(m.gpu_hours for m in self.margins)

    @property
    def gpu_cost(self) -> Decimal:
        return sum((m.gpu_cost for m in self.margins), Decimal("0"))

    @property
    def gpu_busy_hours(self) -> float:
        return sum(m.gpu_busy_hours for m in self.margins)

    @property
    def busy_cost(self) -> Decimal:
        return sum((m.busy_cost for m in self.margins), Decimal("0"))

    @property
    def served_margin(self) -> Decimal:
        return self.revenue - self.busy_cost

    @property
    def margin(self) -> Decimal:
        return self.revenue - self.gpu_cost


def operator_home(*, now: datetime) -> OperatorHome:
    try:
        traffic = traffic_snapshot(
            now=now.timestamp(),
            rate_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
            popular_window_s=settings.AUTOSCALE_RATE_WINDOW_SECONDS,
        )
        requests_per_s = sum(traffic.rate_per_s.values())
    except Exception:  # Redis down: the page still shows everything else
        logger.warning("the home page could not read the gateways' request counters", exc_info=True)
        requests_per_s = None
    return OperatorHome(
        fleet=fleet_health(now=now, failures_since=now - ERRORS_WINDOW),
        requests_per_s=requests_per_s,
        last_hour=usage_totals(since=now - ERRORS_WINDOW, until=now),
        refused_last_hour=refusal_totals(since=now - ERRORS_WINDOW, until=now),
    )


def tenant_home(*, tenant, now: datetime) -> TenantHome:
    month = usage_month_summary(tenant=tenant, now=now)
    day_start = datetime.combine(now.astimezone(UTC).date(), datetime.min.time(), tzinfo=UTC)
    today = usage_totals(since=day_start, until=now, tenant=tenant)
    refused = refusal_totals(since=day_start, until=now, tenant=tenant)
    usable = [key for key in api_keys_unrevoked_for_tenant(tenant=tenant) if not key.is_expired(now)]
    usable.sort(key=lambda key: (key.last_used_at is None, -(key.last_used_at or now).timestamp()))
    return TenantHome(
        spend_this_month=month.totals.revenue,
        balance=month.balance,
        allowance_left=allowance_this_month(tenant=tenant, now=now).left if tenant.plan_id else None,
        included_per_month=tenant.plan.included_requests_per_month if tenant.plan else 0,
        requests_today=today.requests + refused.refused,
        failed_today=today.failed + refused.refused,
        shed_today=refused.shed,
        latency_today=usage_latency(since=day_start, until=now, tenant=tenant),
        keys=usable,
    )


def admin_home(*, now: datetime) -> AdminHome:
    since = month_start_of(now)
    totals = usage_totals(since=since, until=now)
    return AdminHome(
        since=since,
        revenue=totals.revenue,
        requests=totals.requests,
        gpu_hour_cost=settings.GPU_HOUR_COST_USD,
        margins=model_margins(since=since, until=now, gpu_hour_cost=settings.GPU_HOUR_COST_USD),
        top_tenants=usage_by(group_by="tenant", since=since, until=now)[:TOP_TENANTS],
    )


def home_sections(*, user, now: datetime | None = None) -> dict:
    """The sections `user` may see, by name ("operator", "tenant", "admin"); a user with several
    roles' rights gets each of them."""
    now = now or timezone.now()
    sections = {}
    if has_role(user, OPERATOR_ROLES):
        sections["operator"] = operator_home(now=now)
    if has_role(user, TENANT_ROLES) and user.tenant is not None:
        sections["tenant"] = tenant_home(tenant=user.tenant, now=now)
    if has_role(user, ADMIN_ROLES):
        sections["admin"] = admin_home(now=now)
    return sections
