from django.contrib import admin

from controlplane.audit.models import AuditEntry
from controlplane.common.admin import ReadOnlyAdmin


@admin.register(AuditEntry)
class AuditEntryAdmin(ReadOnlyAdmin):
    """Read-only: the log is history, so nobody edits or deletes it through the admin."""

    list_display = ["created_at", "actor_label", "source_address", "action", "target_type", "target_label"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_label", "target_label", "source_address"]
    date_hierarchy = "created_at"
