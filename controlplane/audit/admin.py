from django.contrib import admin

from controlplane.audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """Read-only: the log is history, so nobody edits or deletes it through the admin."""

    list_display = ["created_at", "actor_label", "action", "target_type", "target_label"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_label", "target_label"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
