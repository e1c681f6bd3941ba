"""The gateway's reads: an API key with everything admission needs, and the routing table."""

from dataclasses import dataclass
from decimal import Decimal

from controlplane.accounts.selectors import api_key_allowed_model_ids, api_key_authenticate
from controlplane.catalog.models import Model
from controlplane.fleet.models import Replica, Worker


@dataclass(frozen=True)
class KeyGrant:
    """A usable API key as the gateway caches it: who calls, what it may call, how often."""

    key_id: int
    tenant_id: int
    expires_at: float | None  # epoch seconds
    allowed_model_ids: frozenset[int] | None  # None: every model
    key_rate_limit_per_minute: int
    tenant_rate_limit_per_minute: int
    key_max_concurrent: int
    tenant_max_concurrent: int
    plan_id: int | None = None  # so that a change to the plan drops the key (keys.KeyCache)

    def allows(self, model_id: int) -> bool:
        return self.allowed_model_ids is None or model_id in self.allowed_model_ids


@dataclass(frozen=True)
class ReplicaRoute:
    replica_id: int
    endpoint_url: str


@dataclass(frozen=True)
class ModelRoute:
    model_id: int
    public_name: str
    kind: str
    price_per_request: Decimal
    created: int  # epoch seconds, for /v1/models
    keep_warm: bool
    ready: tuple[ReplicaRoute, ...]
    loading: bool  # some replica is pending or loading


def key_grant_for(*, plaintext: str, default_rate_limit_per_minute: int, default_max_concurrent: int) -> KeyGrant:
    """The grant of a usable key; raises accounts' ApiKeyRejected otherwise."""
    api_key = api_key_authenticate(plaintext=plaintext)
    plan = api_key.tenant.plan
    tenant_rpm = plan.rate_limit_per_minute if plan else default_rate_limit_per_minute
    tenant_concurrent = plan.max_concurrent_requests if plan else default_max_concurrent
    return KeyGrant(
        key_id=api_key.pk,
        tenant_id=api_key.tenant_id,
        plan_id=api_key.tenant.plan_id,
        expires_at=api_key.expires_at.timestamp() if api_key.expires_at else None,
        allowed_model_ids=api_key_allowed_model_ids(api_key=api_key),
        key_rate_limit_per_minute=api_key.rate_limit_per_minute or tenant_rpm,
        tenant_rate_limit_per_minute=tenant_rpm,
        key_max_concurrent=api_key.max_concurrent_requests or tenant_concurrent,
        tenant_max_concurrent=tenant_concurrent,
    )


def routing_table() -> dict[str, ModelRoute]:
    """Every enabled model by public name, with its ready replicas (on online workers)."""
    ready: dict[int, list[ReplicaRoute]] = {}
    loading: set[int] = set()
    replicas = Replica.objects.filter(
        deployment__model__enabled=True,
        state__in=[Replica.State.READY, Replica.State.PENDING, Replica.State.LOADING],
    ).order_by("pk").values_list("pk", "state", "endpoint_url", "deployment__model_id", "worker__state")
    for replica_id, state, endpoint_url, model_id, worker_state in replicas:
        if state != Replica.State.READY:
            loading.add(model_id)
        elif endpoint_url and worker_state == Worker.State.ONLINE:
            ready.setdefault(model_id, []).append(ReplicaRoute(replica_id, endpoint_url.rstrip("/")))
    models = Model.objects.filter(enabled=True).values_list(
        "pk", "public_name", "kind", "price_tier__price_per_request", "created_at", "deployment__keep_warm"
    )
    return {
        name: ModelRoute(
            model_id=pk, public_name=name, kind=kind, price_per_request=price, created=int(created_at.timestamp()),
            keep_warm=bool(keep_warm), ready=tuple(ready.get(pk, ())), loading=pk in loading,
        )
        for pk, name, kind, price, created_at, keep_warm in models
    }
