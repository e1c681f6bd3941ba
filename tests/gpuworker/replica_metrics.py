"""A replica's /metrics read back in tests: the fair scheduler's per-tenant figures."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def tenant_figures(metrics: str) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """(tenant, priority) -> weighted tokens served, and tenant -> weight."""
    served, weights = {}, {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "gpuserve_tenant_service_tokens_total":
                served[sample.labels["tenant"], sample.labels["priority"]] = sample.value
            elif sample.name == "gpuserve_tenant_weight":
                weights[sample.labels["tenant"]] = sample.value
    return served, weights
