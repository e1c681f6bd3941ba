from django.contrib import admin

from controlplane.billing.models import CreditEntry, Plan, PriceTier, UsageRecord
from controlplane.common.admin import ReadOnlyAdmin


@admin.register(PriceTier)
class PriceTierAdmin(admin.ModelAdmin):
    list_display = ["name", "price_per_request", "batch_price_per_request", "reference_price_per_million_tokens"]
    search_fields = ["name"]


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ["name", "included_requests_per_month", "rate_limit_per_minute"]
    search_fields = ["name"]


@admin.register(CreditEntry)
class CreditEntryAdmin(ReadOnlyAdmin):
    """The ledger is append-only: corrections are new entries, made by the credit services."""

    list_display = ["created_at", "tenant", "kind", "amount", "memo"]
    list_filter = ["kind"]
    search_fields = ["tenant__name", "memo"]


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    """Usage is written by the gateway's credit holds, once per request."""

    list_display = [
        "created_at",
        "request_id",
        "tenant",
        "model",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "total_latency_ms",
        "price_charged",
    ]
    list_filter = ["status", "model"]
    search_fields = ["request_id", "tenant__name"]
