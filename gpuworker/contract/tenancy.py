"""Who a request is served for, as the gateway tells the replica in headers: the tenant, the
tenant's weight (its plan's share) and the request's priority class. The replica hands them to its
engine's fair scheduler as SamplingParams fields (tenant, tenant_weight, priority), which check them."""

from __future__ import annotations

from collections.abc import Mapping

TENANT_HEADER = "x-gpuserve-tenant"
TENANT_WEIGHT_HEADER = "x-gpuserve-tenant-weight"
PRIORITY_HEADER = "x-gpuserve-priority"
# The priority classes: the batch API's work and keys marked batch give way to interactive requests.
INTERACTIVE = "interactive"
BATCH = "batch"


def tenancy_headers(*, tenant_id: int, weight: float, batch: bool) -> dict[str, str]:
    return {
        TENANT_HEADER: str(tenant_id),
        TENANT_WEIGHT_HEADER: repr(float(weight)),
        PRIORITY_HEADER: BATCH if batch else INTERACTIVE,
    }


def tenancy_fields(headers: Mapping[str, str]) -> dict[str, object]:
    """The SamplingParams fields the headers give (none for a request sent without them, which is
    served as the default tenant's); ValueError naming a weight header that is not a number."""
    fields: dict[str, object] = {}
    if (tenant := headers.get(TENANT_HEADER)) is not None:
        fields["tenant"] = tenant
    if (weight := headers.get(TENANT_WEIGHT_HEADER)) is not None:
        try:
            fields["tenant_weight"] = float(weight)
        except ValueError:
            raise ValueError(f"{TENANT_WEIGHT_HEADER} must be a number, got {weight!r}") from None
    if (priority := headers.get(PRIORITY_HEADER)) is not None:
        fields["priority"] = priority
    return fields
