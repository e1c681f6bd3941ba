"""The gateway's reads: an API key with everything admission needs, and the routing table."""

from dataclasses import dataclass
from decimal import Decimal

from django.conf import settings

from controlplane.accounts.selectors import api_key_allowed_model_ids, api_key_authenticate
from controlplane.catalog.models import Model
from controlplane.common.units import human_bytes
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.placement import largest_replica_bytes
from controlplane.fleet.selectors import placement_slots, replica_prefix_keys
from controlplane.gateway.body_check import model_request_bytes


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
    # The conversations whose KV it holds (gpuworker.contract.prefix_keys digests), as last reported.
    prefix_keys: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ModelRoute:
    model_id: int
    public_name: str
    kind: str
    price_per_request: Decimal
    created: int  # epoch seconds, for /v1/models
    context_length: int  # tokens, as the catalog says: no replica of the model takes more
    # The largest request body it takes (follows context_length, under GATEWAY_MAX_REQUEST_BYTES).
    max_request_bytes: int
    ready: tuple[ReplicaRoute, ...]
    loading: bool  # some replica is pending or loading
    # Why no replica can be started for a request (empty when one can): see `cold_start_refusal`.
    cannot_start: str = ""
    # A vision model's limits on a request's images (the catalog's).
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20

    @property
    def servable(self) -> bool:
        """Listed by /v1/models and waited for by requests: ready now, or a replica can be started."""
        return bool(self.ready) or self.loading or not self.cannot_start


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
    """Every enabled model by public name, with its ready replicas (on online workers) and whether
    a replica of it could be started for a request."""
    ready: dict[int, list[ReplicaRoute]] = {}
    loading: set[int] = set()
    replicas = list(
        Replica.objects.filter(
            deployment__model__enabled=True,
            state__in=[Replica.State.READY, Replica.State.PENDING, Replica.State.LOADING],
        )
        .order_by("pk")
        .values_list("pk", "state", "endpoint_url", "deployment__model_id", "worker__state", "worker_id")
    )
    # Where each ready replica's KV tiers hold which conversations (its worker's latest heartbeat).
    prefix_keys = replica_prefix_keys(
        worker_ids=sorted({worker_id for _, state, *_, worker_id in replicas if state == Replica.State.READY})
    )
    for replica_id, state, endpoint_url, model_id, worker_state, _ in replicas:
        if state != Replica.State.READY:
            loading.add(model_id)
        elif endpoint_url and worker_state == Worker.State.ONLINE:
            route = ReplicaRoute(replica_id, endpoint_url.rstrip("/"), prefix_keys.get(replica_id, frozenset()))
            ready.setdefault(model_id, []).append(route)
    slots = placement_slots(workers=list(Worker.objects.filter(state=Worker.State.ONLINE)))
    models = list(
        Model.objects.filter(enabled=True).values_list(
            "pk",
            "public_name",
            "kind",
            "price_tier__price_per_request",
            "created_at",
            "context_length",
            "gpu_memory_bytes",
            "deployment__max_replicas",
            "tensor_parallel_size",
            "max_images_per_request",
            "max_image_bytes",
        )
    )
    largest = {size: largest_replica_bytes(slots=slots, tensor_parallel_size=size) for size in {m[8] for m in models}}
    return {
        name: ModelRoute(
            model_id=pk,
            public_name=name,
            kind=kind,
            price_per_request=price,
            created=int(created_at.timestamp()),
            context_length=context_length,
            max_request_bytes=model_request_bytes(
                context_length=context_length,
                cap=settings.GATEWAY_MAX_REQUEST_BYTES,
                bytes_per_token=settings.GATEWAY_REQUEST_BYTES_PER_TOKEN,
                allowance=settings.GATEWAY_REQUEST_BYTES_ALLOWANCE,
                image_bytes=max_images * max_image_bytes if kind == Model.Kind.VISION else 0,
            ),
            ready=tuple(ready.get(pk, ())),
            loading=pk in loading,
            cannot_start=cold_start_refusal(
                need_bytes=need, max_replicas=max_replicas, largest_slot_bytes=largest[size], tensor_parallel_size=size
            ),
            max_images_per_request=max_images,
            max_image_bytes=max_image_bytes,
        )
        for (
            pk,
            name,
            kind,
            price,
            created_at,
            context_length,
            need,
            max_replicas,
            size,
            max_images,
            max_image_bytes,
        ) in models
    }


def cold_start_refusal(
    *, need_bytes: int, max_replicas: int | None, largest_slot_bytes: int | None, tensor_parallel_size: int = 1
) -> str:
    """Why a replica of a model cannot be started for a waiting request, or "" when it can: the
    model needs a deployment that allows a replica, and an online worker with a GPU (or, CPU-only,
    memory; split over N GPUs: N GPUs of one worker together, fleet.placement.largest_replica_bytes)
    at least as large as the model's estimate. Capacity, not what is free right now: room
    is made by scaling other models down, and a model must not drop out of /v1/models whenever
    the fleet is busy."""
    if max_replicas is None:
        return "it has no deployment"
    if max_replicas < 1:
        return "its deployment allows no replicas (max_replicas is 0)"
    if largest_slot_bytes is None:
        return "no worker is online"
    if need_bytes > largest_slot_bytes:
        over = f" over {tensor_parallel_size} GPUs of one worker" if tensor_parallel_size > 1 else ""
        return (
            f"it needs {human_bytes(need_bytes)}{over} and no online worker has that much GPU memory (or, "
            f"CPU-only, memory): the largest has {human_bytes(largest_slot_bytes)}"
        )
    return ""
