"""The margin per model for the admins' home page: billing's revenue against the fleet's GPU time,
composed here, above both apps, so that neither reads the other."""

from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from controlplane.billing.reports import usage_by
from controlplane.common.money import MICRO
from controlplane.fleet.selectors import gpu_busy_seconds_by_model, gpu_seconds_by_model


@dataclass(frozen=True)
class ModelMargin:
    """A model's flat-price revenue in a period against its GPU time: the time its requests kept
    GPUs busy (unit economics: what serving cost) and the time its replicas held GPUs (what the
    operator paid for, idle time included)."""

    model: str
    requests: int
    revenue: Decimal
    gpu_busy_hours: float
    busy_cost: Decimal
    gpu_hours: float
    gpu_cost: Decimal
    # Prompt tokens its replicas' prefix caches served: prefill its GPUs did not compute.
    prefill_tokens_saved: int = 0

    @property
    def served_margin(self) -> Decimal:
        """Revenue less the cost of the GPU time the requests used."""
        return self.revenue - self.busy_cost

    @property
    def margin(self) -> Decimal:
        """Revenue less the cost of the GPUs held, busy or idle."""
        return self.revenue - self.gpu_cost

    @property
    def utilisation_pct(self) -> float | None:
        """How much of the GPU time held the requests used; None when no GPU was held."""
        return 100 * self.gpu_busy_hours / self.gpu_hours if self.gpu_hours else None


def _cost(hours: float, gpu_hour_cost: Decimal) -> Decimal:
    return (gpu_hour_cost * Decimal(str(hours))).quantize(MICRO)


def model_margins(*, since: datetime, until: datetime, gpu_hour_cost: Decimal) -> list[ModelMargin]:
    """Per model: revenue charged at the flat price (billing's usage records, `billing.reports.usage_by`)
    against `gpu_hour_cost` (settings.GPU_HOUR_COST_USD) times the GPU-hours its requests kept busy
    (`fleet.selectors.gpu_busy_seconds_by_model`, from the engine's per-request GPU seconds) and
    the GPU-hours its replicas held (`fleet.selectors.gpu_seconds_by_model`, from the replicas'
    recorded lifetimes). Largest revenue first; a model whose GPUs earned nothing is listed too."""
    revenue = {row.key: row for row in usage_by(group_by="model", since=since, until=until)}
    held = gpu_seconds_by_model(since=since, until=until)
    busy = gpu_busy_seconds_by_model(since=since, until=until)
    others = sorted({*held, *busy} - set(revenue))
    margins = []
    for model in [*revenue, *others]:
        held_hours, busy_hours = held.get(model, 0.0) / 3600, busy.get(model, 0.0) / 3600
        row = revenue.get(model)
        margins.append(
            ModelMargin(
                model=model,
                requests=row.requests if row else 0,
                revenue=row.revenue if row else Decimal("0"),
                gpu_busy_hours=busy_hours,
                busy_cost=_cost(busy_hours, gpu_hour_cost),
                gpu_hours=held_hours,
                gpu_cost=_cost(held_hours, gpu_hour_cost),
                prefill_tokens_saved=row.cached_prompt_tokens if row else 0,
            )
        )
    return margins
