"""The margin per model for the admins' home page: billing's revenue against the fleet's GPU-hours,
composed here, above both apps, so that neither reads the other."""

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from controlplane.billing.reports import usage_by
from controlplane.common.money import MICRO
from controlplane.fleet.selectors import gpu_seconds_by_model


@dataclass(frozen=True)
class ModelMargin:
    """A model's flat-price revenue in a period against what its GPUs cost in that period."""

    model: str
    requests: int
    revenue: Decimal
    gpu_hours: float
    gpu_cost: Decimal
    # Prompt tokens its replicas' prefix caches served: prefill its GPUs did not compute.
    prefill_tokens_saved: int = 0

    @property
    def margin(self) -> Decimal:
        return self.revenue - self.gpu_cost


def model_margins(*, since: datetime, until: datetime, gpu_hour_cost: Decimal) -> list[ModelMargin]:
    """Per model: revenue charged at the flat price (billing's usage records, `billing.reports.usage_by`)
    against the GPU-hours its replicas held a GPU (`fleet.selectors.gpu_seconds_by_model`, from the
    replicas' recorded lifetimes) times `gpu_hour_cost` (settings.GPU_HOUR_COST_USD). Largest revenue
    first; a model whose GPUs earned nothing is listed too, with its cost."""
    revenue = {row.key: row for row in usage_by(group_by="model", since=since, until=until)}
    seconds = gpu_seconds_by_model(since=since, until=until)
    margins = []
    for model in [*revenue, *sorted(name for name in seconds if name not in revenue)]:
        hours = seconds.get(model, 0.0) / 3600
        row = revenue.get(model)
        margins.append(
            ModelMargin(
                model=model,
                requests=row.requests if row else 0,
                revenue=row.revenue if row else Decimal("0"),
                gpu_hours=hours,
                gpu_cost=(gpu_hour_cost * Decimal(str(hours))).quantize(MICRO),
                prefill_tokens_saved=row.cached_prompt_tokens if row else 0,
            )
        )
    return margins
