"""Prometheus metrics of one serving engine, under the names operators know from vLLM.

Keeping vLLM's metric names lets existing dashboards and alerts work unchanged against our
worker. Each server owns a `CollectorRegistry`, so several engines in one process (tests, or
several small replicas on one GPU) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


class EngineMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.host_cache_hits = counter(
            "gpuserve:host_kv_cache_hits", "Prompt tokens whose KV was copied back from the host KV tier."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("vllm:num_preemptions", "Sequences preempted for lack of KV blocks.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency from arrival to finish.", LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited before its first scheduling.", LATENCY_BUCKETS
        )

        # Per tenant (the gateway's tenant id; "" for requests that name none) and priority class:
        # the weighted tokens the fair scheduler counted (engine.fair_share), so that a tenant's
        # share of this replica is its rate over the sum's.
        self.tenant_service = Counter(
            "gpuserve_tenant_service_tokens",
            "Weighted tokens served per tenant and priority class (prompt 1, output 2, recomputation included).",
            ["model_name", "tenant", "priority"],
            registry=r,
        )
        self.tenant_weight = Gauge(
            "gpuserve_tenant_weight",
            "The fair-share weight a tenant's requests came with.",
            ["model_name", "tenant"],
            registry=r,
        )
        self.model_name = model_name

    def count_tenant_service(self, tenant: str, priority: str, tokens: float) -> None:
        self.tenant_service.labels(self.model_name, tenant, priority).inc(tokens)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.tenant_weight.labels(self.model_name, tenant).set(weight)

    def render(self) -> bytes:
        return generate_latest(self.registry)
