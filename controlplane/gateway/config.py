"""The gateway's settings, read once from Django settings into one frozen object."""

from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class GatewayConfig:
    redis_url: str
    worker_token: str
    key_cache_s: float
    key_changes_poll_s: float
    routing_refresh_s: float
    cold_start_wait_s: float
    cold_start_queue_max: int
    retry_after_s: int
    connect_timeout_s: float
    request_timeout_s: float
    max_request_bytes: int
    inline_body_bytes: int
    body_parsers: int
    body_parsers_per_tenant: int
    replica_cooldown_s: float
    default_rate_limit_per_minute: int
    default_max_concurrent_requests: int
    affinity_prefix_chars: int
    affinity_max_extra: int
    idempotency_s: int
    hold_sweep_s: float
    refusal_flush_s: float = 5.0

    @property
    def hold_lifetime_s(self) -> float:
        # A hold must outlive the longest request, or the sweeper could settle a live one; a
        # request that waited for a cold start was held through the wait too.
        return self.cold_start_wait_s + self.request_timeout_s + 60.0

    @classmethod
    def from_settings(cls) -> "GatewayConfig":
        worker_token = getattr(settings, "FLEET_WORKER_TOKEN", "")
        if not worker_token:
            raise ImproperlyConfigured(
                "FLEET_WORKER_TOKEN is not set: the gateway needs the fleet's worker token "
                "(env GPUSERVE_WORKER_TOKEN) to call replicas."
            )
        for name in ("GATEWAY_BODY_PARSERS", "GATEWAY_BODY_PARSERS_PER_TENANT"):
            if getattr(settings, name) < 1:
                raise ImproperlyConfigured(f"{name} must be at least 1; got {getattr(settings, name)}.")
        return cls(
            redis_url=settings.REDIS_URL,
            worker_token=worker_token,
            key_cache_s=float(settings.GATEWAY_KEY_CACHE_SECONDS),
            key_changes_poll_s=settings.GATEWAY_KEY_CHANGES_POLL_MS / 1000.0,
            routing_refresh_s=settings.GATEWAY_ROUTING_REFRESH_MS / 1000.0,
            cold_start_wait_s=float(settings.GATEWAY_COLD_START_WAIT_SECONDS),
            cold_start_queue_max=settings.GATEWAY_COLD_START_QUEUE_MAX,
            retry_after_s=settings.GATEWAY_RETRY_AFTER_SECONDS,
            connect_timeout_s=float(settings.GATEWAY_UPSTREAM_CONNECT_TIMEOUT_SECONDS),
            request_timeout_s=float(settings.GATEWAY_REQUEST_TIMEOUT_SECONDS),
            max_request_bytes=settings.GATEWAY_MAX_REQUEST_BYTES,
            inline_body_bytes=settings.GATEWAY_INLINE_BODY_BYTES,
            body_parsers=settings.GATEWAY_BODY_PARSERS,
            body_parsers_per_tenant=settings.GATEWAY_BODY_PARSERS_PER_TENANT,
            replica_cooldown_s=float(settings.GATEWAY_REPLICA_COOLDOWN_SECONDS),
            default_rate_limit_per_minute=settings.GATEWAY_DEFAULT_RATE_LIMIT_PER_MINUTE,
            default_max_concurrent_requests=settings.GATEWAY_DEFAULT_MAX_CONCURRENT_REQUESTS,
            affinity_prefix_chars=settings.GATEWAY_AFFINITY_PREFIX_CHARS,
            affinity_max_extra=settings.GATEWAY_AFFINITY_MAX_EXTRA,
            idempotency_s=settings.GATEWAY_IDEMPOTENCY_SECONDS,
            hold_sweep_s=float(settings.GATEWAY_HOLD_SWEEP_SECONDS),
            refusal_flush_s=float(settings.GATEWAY_REFUSAL_FLUSH_SECONDS),
        )
