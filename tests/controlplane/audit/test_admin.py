"""The audit log is read-only in the admin: it is history, written only by services."""

from django.contrib import admin
from django.test import RequestFactory

from controlplane.audit.models import AuditEntry
from controlplane.common.admin import ReadOnlyAdmin


def test_the_audit_log_cannot_be_added_to_edited_or_deleted_in_the_admin():
    model_admin = admin.site._registry[AuditEntry]
    request = RequestFactory().get("/admin/")
    assert isinstance(model_admin, ReadOnlyAdmin)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request) and not model_admin.has_delete_permission(request)
