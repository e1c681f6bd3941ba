from django.contrib import admin

from controlplane.batches.models import Batch, BatchFile
from controlplane.common.admin import ReadOnlyAdmin


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    """Batches are written by their services (the API and the runner), never by hand."""

    list_display = [
        "public_id",
        "tenant",
        "endpoint",
        "model_name",
        "status",
        "total",
        "completed",
        "failed",
        "created_at",
    ]
    list_filter = ["status", "endpoint"]
    search_fields = ["public_id", "tenant__name"]


@admin.register(BatchFile)
class BatchFileAdmin(ReadOnlyAdmin):
    list_display = ["public_id", "tenant", "purpose", "filename", "bytes", "lines", "created_at"]
    list_filter = ["purpose"]
    search_fields = ["public_id", "filename", "tenant__name"]
