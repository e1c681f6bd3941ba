"""Admin base classes the apps share."""

from django.contrib import admin


class ReadOnlyAdmin(admin.ModelAdmin):
    """For records only services write (the ledger, usage, the audit log): shown, never added,
    changed or deleted through the admin."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
