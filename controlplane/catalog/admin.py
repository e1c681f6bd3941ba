from django.contrib import admin

from controlplane.catalog.models import Deployment, Model


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["public_name", "family", "kind", "context_length", "tensor_parallel_size", "price_tier", "enabled"]
    list_filter = ["kind", "family", "enabled", "price_tier"]
    search_fields = ["public_name", "family"]


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ["model", "desired_replicas", "min_replicas", "max_replicas", "keep_warm"]
    list_filter = ["keep_warm"]
    search_fields = ["model__public_name"]
