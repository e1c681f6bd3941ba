from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.fleet.models import Gpu, QualityMeasurement, Replica, Worker


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "name", "memory_total_bytes", "present"]
    readonly_fields = fields


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["name", "advertise_host", "device", "state", "state_changed_at"]
    list_filter = ["state", "device"]
    search_fields = ["name", "advertise_host"]
    # Workers register themselves; state comes from heartbeats and the fleet's services.
    readonly_fields = [
        "name",
        "queue_name",
        "advertise_host",
        "device",
        "cpu_memory_total_bytes",
        "cpu_cores",
        "version",
        "state",
        "state_changed_at",
        "created_at",
    ]
    inlines = [GpuInline]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["worker", "index", "name", "memory_total_bytes", "present"]
    search_fields = ["worker__name", "name"]
    # GPUs are what workers report when they register.
    readonly_fields = ["worker", "index", "name", "memory_total_bytes", "present"]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["deployment", "worker", "gpu", "state", "endpoint_url", "state_changed_at"]
    list_filter = ["state"]
    search_fields = ["deployment__model__public_name", "worker__name"]
    # Replicas are placed by reconcile and moved by the state machine in services, never by a form.
    readonly_fields = [
        "deployment",
        "worker",
        "gpu",
        "state",
        "endpoint_url",
        "state_changed_at",
        "last_error",
        "failure",
        "created_at",
    ]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(QualityMeasurement)
class QualityMeasurementAdmin(ReadOnlyAdmin):
    """Measurements are asked for from the catalog and moved on by their workers' reports, never by hand."""

    list_display = ["model", "worker", "device", "state", "created_at", "finished", "reason"]
    list_filter = ["state"]
    search_fields = ["model__public_name", "worker__name"]
    list_select_related = ["model", "worker"]

    @admin.display(description="device")
    def device(self, measurement: QualityMeasurement) -> str:
        return measurement.device_label

    @admin.display(description="finished")
    def finished(self, measurement: QualityMeasurement):
        return measurement.finished_at

    @admin.display(description="reason")
    def reason(self, measurement: QualityMeasurement) -> str:
        return measurement.error
