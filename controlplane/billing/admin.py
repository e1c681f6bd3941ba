from django.contrib import admin

from controlplane.billing.models import CreditEntry, Plan, PriceTier, UsageRecord


@admin.register(PriceTier)
class PriceTierAdmin(admin.ModelAdmin):
    list_display = ["name", "price_per_request", "reference_price_per_million_tokens"]
    search_fields = ["name"]


@admin.register(Plan)
class PlanAdmin(admin.ModelAdmin):
    list_display = ["name", "included_requests_per_month", "rate_limit_per_minute"]
    search_fields = ["name"]


class ReadOnlyAdmin(admin.ModelAdmin):
    """Records written only by services: the ledger is append-only, usage is the gateway's."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(CreditEntry)
class CreditEntryAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "tenant", "kind", "amount", "memo"]
    list_filter = ["kind"]
    search_fields = ["tenant__name", "memo"]


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at", "request_id", "tenant", "model", "status",
        "prompt_tokens", "completion_tokens", "total_latency_ms", "price_charged",
    ]
    list_filter = ["status", "model"]
    search_fields = ["request_id", "tenant__name"]
