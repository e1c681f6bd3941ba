from django.contrib import admin

from controlplane.fleet.models import Gpu, Replica, Worker


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "name", "memory_total_bytes"]
    readonly_fields = fields


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["host", "queue_name", "state", "last_heartbeat_at"]
    list_filter = ["state"]
    search_fields = ["host", "queue_name"]
    # Workers register themselves (the service issues their token); state comes from heartbeats.
    readonly_fields = ["host", "queue_name", "state", "last_heartbeat_at", "created_at"]
    exclude = ["token_hash"]
    inlines = [GpuInline]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["worker", "index", "name", "memory_total_bytes"]
    search_fields = ["worker__host", "name"]
    # GPUs are what workers report when they register.
    readonly_fields = ["worker", "index", "name", "memory_total_bytes"]

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["deployment", "worker", "gpu", "state", "endpoint_url", "state_changed_at"]
    list_filter = ["state"]
    search_fields = ["deployment__model__public_name", "worker__host"]
    # State changes go through the state machine in services, never through a form.
    readonly_fields = ["state", "state_changed_at", "last_error", "created_at"]
