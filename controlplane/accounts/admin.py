from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as DjangoUserAdmin

from controlplane.accounts.models import ApiKey, Invitation, Tenant, User
from controlplane.accounts.services import api_key_revoke
from controlplane.common.admin import ReadOnlyAdmin


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "plan", "is_active", "created_at"]
    list_filter = ["is_active", "plan"]
    search_fields = ["name"]


@admin.register(User)
class UserAdmin(DjangoUserAdmin):
    list_display = ["username", "email", "role", "tenant", "tenant_role", "is_staff", "is_active"]
    list_filter = ["role", "tenant_role", "is_staff", "is_active"]
    fieldsets = DjangoUserAdmin.fieldsets + (("Role", {"fields": ["role", "tenant", "tenant_role"]}),)
    add_fieldsets = DjangoUserAdmin.add_fieldsets + (("Role", {"fields": ["role", "tenant", "tenant_role"]}),)


@admin.register(Invitation)
class InvitationAdmin(ReadOnlyAdmin):
    """Read-only: a link can only be shown by the service that makes it (the team and staff pages)."""

    list_display = ["__str__", "created_by", "created_at", "expires_at", "accepted_by", "revoked"]
    list_filter = ["role", "revoked"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "tenant", "all_models", "revoked", "expires_at", "last_used_at"]
    list_filter = ["revoked", "all_models"]
    search_fields = ["name", "prefix", "tenant__name"]
    readonly_fields = ["prefix", "tenant", "last_used_at", "created_by", "created_at", "revoked"]
    fields = [
        "name",
        "prefix",
        "tenant",
        "all_models",
        "allowed_models",
        "expires_at",
        "rate_limit_per_minute",
        "revoked",
        "last_used_at",
        "created_by",
        "created_at",
    ]
    actions = ["revoke"]

    # A key's plaintext can only be shown by the service that creates it, so keys are not
    # created here (the tenant pages and `seed_demo` do it).
    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Revoke selected keys")
    def revoke(self, request, queryset) -> None:
        for api_key in queryset:
            api_key_revoke(api_key=api_key, actor=request.user)
        self.message_user(request, f"Revoked {queryset.count()} key(s).", messages.SUCCESS)
