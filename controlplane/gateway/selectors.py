"""The gateway's reads: an API key with everything admission needs, and the routing table."""

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from django.conf import settings

from controlplane.accounts.models import ApiKey
from controlplane.accounts.selectors import api_key_allowed_model_ids, api_key_authenticate, api_key_usable_by_id
from controlplane.catalog.models import SERVED_CONTEXT_LENGTH, Model
from controlplane.catalog.selectors import image_rules
from controlplane.common.units import human_bytes
from controlplane.fleet import heartbeat_cache
from controlplane.fleet.models import Replica, Worker
from controlplane.fleet.placement import largest_replica_bytes
from controlplane.fleet.selectors import placement_slots, replica_prefix_keys
from controlplane.gateway.body_check import CheckedBody, model_request_bytes
from controlplane.gateway.replica_choice import image_tokens_estimate, predicted_wait_s, prompt_tokens_estimate
from gpuworker.contract.openai_api import ImageRules


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
    # The engine's fair scheduler: the tenant's share (its plan's weight) and whether the key's
    # requests are batch work, which gives way to interactive requests.
    fair_share_weight: int = 1
    batch_priority: bool = False

    def allows(self, model_id: int) -> bool:
        return self.allowed_model_ids is None or model_id in self.allowed_model_ids


@dataclass(frozen=True)
class ReplicaRoute:
    replica_id: int
    endpoint_url: str
    # The conversations whose KV it holds (gpuworker.contract.prefix_keys digests), as last reported.
    prefix_keys: frozenset[str] = frozenset()
    # From the replica's latest load report (replica_choice.predicted_wait_s); 0 without one. The
    # route a pick answers (shared.RedisShared.pick) adds the requests routed there since the report
    # and takes off what the replica has prefilled since.
    predicted_wait_s: float = 0.0
    # That report: when it came (epoch seconds; 0: none recent) and its figures the wait is from.
    report_at: float = 0.0
    waiting_tokens: int = 0
    prefill_tokens_per_s: float = 0.0

    def with_routed(self, routed: Sequence[tuple[float, int]], now: float | None = None) -> "ReplicaRoute":
        """This route as a pick answers it `now` (epoch seconds; the clock's by default): its
        predicted wait counts the requests routed to it since its load report (by every gateway
        process; `routed`: (when sent, epoch seconds; prompt tokens), in the order sent), which the
        report could not show, less what the replica has prefilled since the report."""
        figures = {"waiting_tokens": self.waiting_tokens, "prefill_tokens_per_s": self.prefill_tokens_per_s}
        now = time.time() if now is None else now
        since = [(at - self.report_at, tokens) for at, tokens in routed] if self.report_at else []
        since_report_s = now - self.report_at if self.report_at else 0.0
        return replace(self, predicted_wait_s=predicted_wait_s(figures, since, since_report_s))


@dataclass(frozen=True)
class ModelRoute:
    model_id: int
    public_name: str
    kind: str
    price_per_request: Decimal
    created: int  # epoch seconds, for /v1/models
    # Tokens, as the catalog says (its max_model_len where set): no replica of the model takes more.
    context_length: int
    # The largest request body it takes (follows context_length, under GATEWAY_MAX_REQUEST_BYTES).
    max_request_bytes: int
    ready: tuple[ReplicaRoute, ...]
    loading: bool  # some replica is pending or loading
    # Why no replica can be started for a request (empty when one can): see `cold_start_refusal`.
    cannot_start: str = ""
    # A vision model's limits on a request's images (the catalog's).
    max_images_per_request: int = 16
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 8192 * 8192
    low_detail_pixels: int = 512 * 512
    # The checkpoint's family (config.json's model_type): some make a fixed number of tokens an image.
    family: str = ""
    # The deployment's TTFT objective: a request predicted to wait longer is shed; None: never.
    ttft_objective_s: float | None = None

    @property
    def image_rules(self) -> ImageRules:
        return image_rules(
            public_name=self.public_name,
            kind=self.kind,
            max_images_per_request=self.max_images_per_request,
            max_image_bytes=self.max_image_bytes,
        )

    def prompt_tokens_estimate(self, body_bytes: int, checked: CheckedBody) -> int:
        """The prompt tokens a request of `body_bytes` bytes, `checked`, is routed as
        (replica_choice.prompt_tokens_estimate): the bytes other than its images' URLs as text, and
        each image as the tokens the model makes of one of its size, read from its data: URL's
        header, or of the largest it takes where the size is not known before the replica fetches
        or decodes it (replica_choice.image_tokens_estimate)."""
        images = sum(
            image_tokens_estimate(detail, self.max_image_pixels, self.low_detail_pixels, size, self.family)
            for detail, size in zip(checked.image_details, checked.image_dimensions, strict=True)
        )
        return prompt_tokens_estimate(max(0, body_bytes - checked.image_url_chars), images)

    def over_objective(self, replica: ReplicaRoute) -> bool:
        """Whether a request routed to `replica` (as its pick answered it) is predicted to wait
        longer than the TTFT objective: then it is shed."""
        return self.ttft_objective_s is not None and replica.predicted_wait_s > self.ttft_objective_s

    @property
    def servable(self) -> bool:
        """Listed by /v1/models and waited for by requests: ready now, or a replica can be started."""
        return bool(self.ready) or self.loading or not self.cannot_start


def key_grant_for(*, plaintext: str, default_rate_limit_per_minute: int, default_max_concurrent: int) -> KeyGrant:
    """The grant of a usable key; raises accounts' ApiKeyRejected otherwise."""
    return _grant(api_key_authenticate(plaintext=plaintext), default_rate_limit_per_minute, default_max_concurrent)


def key_grant_for_id(*, key_id: int, default_rate_limit_per_minute: int, default_max_concurrent: int) -> KeyGrant:
    """`key_grant_for` by the key's id: for a request resumed without its caller (a background
    response), still refused once its key no longer may be used."""
    return _grant(api_key_usable_by_id(key_id=key_id), default_rate_limit_per_minute, default_max_concurrent)


def _grant(api_key: ApiKey, default_rate_limit_per_minute: int, default_max_concurrent: int) -> KeyGrant:
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
        fair_share_weight=plan.fair_share_weight if plan else 1,
        batch_priority=api_key.batch_priority,
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
    ready_workers = sorted({row[5] for row in replicas if row[1] == Replica.State.READY})
    # The ready replicas' workers' latest heartbeats, read once and kept while recent: where each
    # replica's KV tiers hold which conversations, and how long a request would wait there.
    heartbeats = _recent(heartbeat_cache.read_many(worker_ids=ready_workers))
    prefix_keys = replica_prefix_keys(heartbeats)
    reports = _load_reports(heartbeats)
    for replica_id, state, endpoint_url, model_id, worker_state, _ in replicas:
        if state != Replica.State.READY:
            loading.add(model_id)
        elif endpoint_url and worker_state == Worker.State.ONLINE:
            route = ReplicaRoute(
                replica_id,
                endpoint_url.rstrip("/"),
                prefix_keys=prefix_keys.get(replica_id, frozenset()),
                **reports.get(replica_id, {}),
            )
            ready.setdefault(model_id, []).append(route)
    slots = placement_slots(workers=list(Worker.objects.filter(state=Worker.State.ONLINE)))
    models = list(
        Model.objects.filter(enabled=True).values_list(
            "pk",
            "public_name",
            "kind",
            "price_tier__price_per_request",
            "created_at",
            SERVED_CONTEXT_LENGTH,
            "gpu_memory_bytes",
            "deployment__max_replicas",
            "tensor_parallel_size",
            "max_images_per_request",
            "max_image_bytes",
            "max_image_pixels",
            "low_detail_pixels",
            "deployment__ttft_slo_ms",
            "family",
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
            max_image_pixels=max_image_pixels,
            low_detail_pixels=low_detail_pixels,
            family=family,
            ttft_objective_s=None if ttft_slo_ms is None else ttft_slo_ms / 1000,
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
            max_image_pixels,
            low_detail_pixels,
            ttft_slo_ms,
            family,
        ) in models
    }


# Seconds a worker's heartbeat counts for routing (they come about every second): an older one says
# nothing of a replica's queue or of what its KV tiers hold now.
LOAD_REPORT_MAX_AGE_S = 10.0


def _recent(heartbeats: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    now = time.time()
    return {
        worker_id: state
        for worker_id, state in heartbeats.items()
        if now - state.get("received_at", 0) <= LOAD_REPORT_MAX_AGE_S
    }


def _load_reports(heartbeats: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each replica's load report by id (ReplicaRoute's fields), from its worker's latest heartbeat
    (`heartbeats`, by worker id, recent ones only)."""
    reports = {}
    for state in heartbeats.values():
        received_at = state["received_at"]
        for replica_id, figures in (state.get("replicas") or {}).items():
            waiting, rate = figures.get("waiting_tokens"), figures.get("prefill_tokens_per_s")
            reports[int(replica_id)] = {
                "predicted_wait_s": predicted_wait_s(figures),
                "report_at": received_at,
                "waiting_tokens": int(waiting) if isinstance(waiting, int | float) else 0,
                "prefill_tokens_per_s": float(rate) if isinstance(rate, int | float) else 0.0,
            }
    return reports


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
