"""Tenants (the paying organisations), users and their roles, and tenants' API keys."""

from django.contrib.auth.models import AbstractUser, UserManager
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models.functions import Now
from django.utils import timezone

from controlplane.common.money import MoneyField


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    plan = models.ForeignKey("billing.Plan", on_delete=models.PROTECT, null=True, blank=True, related_name="tenants")
    # Tenants are deactivated, never deleted: their ledger and usage history must stay.
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class _UserManager(UserManager):
    def create_superuser(self, username, email=None, password=None, **extra_fields):
        extra_fields.setdefault("role", User.Role.ADMIN)
        return super().create_superuser(username, email, password, **extra_fields)


class User(AbstractUser):
    class Role(models.TextChoices):
        OPERATOR = "operator", "Operator"
        TENANT_MEMBER = "tenant_member", "Tenant member"
        ADMIN = "admin", "Admin"

    class TenantRole(models.TextChoices):
        # Within a tenant: its admins manage the team (invite, set roles, remove); members use it.
        ADMIN = "admin", "Tenant admin"
        MEMBER = "member", "Member"

    role = models.CharField(max_length=20, choices=Role.choices, default=Role.TENANT_MEMBER)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, null=True, blank=True, related_name="members")
    tenant_role = models.CharField(
        max_length=20,
        choices=TenantRole.choices,
        default=TenantRole.MEMBER,
        help_text="A tenant member's part in its team; ignored for operators and admins.",
    )

    objects = _UserManager()

    def clean(self) -> None:
        super().clean()
        if self.role == self.Role.TENANT_MEMBER and self.tenant_id is None:
            raise ValidationError({"tenant": "A tenant member must belong to a tenant."})
        if self.role != self.Role.TENANT_MEMBER and self.tenant_id is not None:
            raise ValidationError({"tenant": "Only tenant members belong to a tenant."})

    @property
    def is_tenant_admin(self) -> bool:
        return self.role == self.Role.TENANT_MEMBER and self.tenant_role == self.TenantRole.ADMIN

    @property
    def role_label(self) -> str:
        """The role as every page names it: a tenant member by their part in the team."""
        return role_label(role=self.role, tenant_role=self.tenant_role)


def role_label(*, role: str, tenant_role: str) -> str:
    if role == User.Role.TENANT_MEMBER:
        return User.TenantRole(tenant_role).label
    return User.Role(role).label


class Invitation(models.Model):
    """A link that lets one person create their own login with the role (and tenant) the inviter
    chose. There is no mail server: the inviter copies the link and passes it on. Only the token's
    hash is kept; the link is shown once, when it is made. Used once, then spent."""

    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    role = models.CharField(max_length=20, choices=User.Role.choices)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, null=True, blank=True, related_name="invitations")
    tenant_role = models.CharField(max_length=20, choices=User.TenantRole.choices, default=User.TenantRole.MEMBER)
    note = models.CharField(max_length=100, blank=True, help_text="Who it is for, so you can tell invitations apart.")
    created_by = models.ForeignKey(User, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(User, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    revoked = models.BooleanField(default=False)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        where = f" to {self.tenant}" if self.tenant_id else ""
        return f"invitation{where} as {self.role_label}" + (f" ({self.note})" if self.note else "")

    @property
    def role_label(self) -> str:
        return role_label(role=self.role, tenant_role=self.tenant_role)

    def refusal(self, now=None) -> str:
        """Why the link cannot be used now, in words for the person holding it; "" if it can."""
        if self.accepted_at is not None:
            return "This invitation has already been used."
        if self.revoked:
            return "This invitation was withdrawn."
        if self.expires_at <= (now or timezone.now()):
            return "This invitation has expired."
        if self.tenant_id is not None and not self.tenant.is_active:
            return "The tenant of this invitation is deactivated."
        return ""


class ApiKey(models.Model):
    class Purpose(models.TextChoices):
        API = "api", "API"
        # Minted by the dashboard for one playground session: short-lived, revoked when the
        # session ends, never listed to the tenant. Its requests go through the gateway like any.
        PLAYGROUND = "playground", "Playground session"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="api_keys")
    purpose = models.CharField(max_length=20, choices=Purpose.choices, default=Purpose.API)
    name = models.CharField(max_length=100)
    # What the owner sees in lists ("sk-AbCdEfGh"); the key itself exists only in the creation result.
    prefix = models.CharField(max_length=16, editable=False)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    all_models = models.BooleanField(default=True, help_text="Allow every enabled model.")
    allowed_models = models.ManyToManyField(
        "catalog.Model",
        blank=True,
        related_name="api_keys",
        help_text="Used only when 'all models' is off.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)
    last_used_at = models.DateTimeField(null=True, blank=True)
    rate_limit_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests per minute for this key; empty means the tenant's plan limit.",
    )
    max_concurrent_requests = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Requests in flight at once for this key; empty means the tenant's plan limit.",
    )
    batch_priority = models.BooleanField(
        default=False,
        help_text="Its requests are batch work: on a busy GPU they give way to interactive requests, "
        "which may pause them.",
    )
    monthly_spend_limit = MoneyField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0)],
        help_text="Most this key may spend in a calendar month (UTC); empty means no limit beyond the credit.",
    )
    created_by = models.ForeignKey("accounts.User", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name"],
                name="apikey_unique_name_per_tenant",
                violation_error_message="This tenant already has a key with this name.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def is_expired(self, now=None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


class ApiKeyChange(models.Model):
    """A change to what a key may do (the key itself, its tenant or the tenant's plan), written in
    the transaction that makes it. Gateway processes cache keys, and read these rows about twice a
    second to drop what changed: a change reaches them even when the Redis announcement is lost.
    Rows are kept for a day (`accounts.services.api_key_changes_record` prunes older ones)."""

    # Plain ids, not foreign keys: the row must outlive a deleted key and never block a delete.
    key_hash = models.CharField(max_length=64, blank=True)
    tenant_id = models.BigIntegerField(null=True)
    plan_id = models.BigIntegerField(null=True)
    # The database's clock (the transaction's start), so that readers compare it with their own
    # query's `now()` and no two hosts' clocks need to agree.
    changed_at = models.DateTimeField(db_default=Now(), db_index=True)

    def __str__(self) -> str:
        return f"change {self.pk}: key {self.key_hash[:8]} tenant {self.tenant_id} plan {self.plan_id}"
