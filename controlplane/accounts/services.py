"""Writes for tenants, users and API keys. Every service validates fully and is atomic."""

import functools
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from controlplane.accounts.keys import generate_api_key, hash_api_key, visible_prefix
from controlplane.accounts.models import ApiKey, ApiKeyChange, Invitation, Tenant, User
from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, changes
from controlplane.catalog.selectors import models_by_public_name
from controlplane.common.money import format_usd
from controlplane.common.services import validated_save
from controlplane.tokens import new_secret_token, secret_hash

logger = logging.getLogger(__name__)

# Gateway processes cache keys by hash. Every change is an `ApiKeyChange` row, which they poll;
# it is also announced here (the key's hash, or ALL_KEYS_CHANGED for a tenant or plan) so they
# act at once instead of at their next poll. Announcements are only a hint: they are lost while
# Redis is down, the rows are not.
API_KEY_CHANGES_CHANNEL = "gpuserve:api-key-changes"
ALL_KEYS_CHANGED = "*"
# Far longer than a gateway's look-back (gateway.keys), which drops every cached key when it has
# not read the changes for longer than that.
API_KEY_CHANGE_RETENTION = timedelta(days=1)
# `last_used_at` is a "recently used" hint, not an audit log: one write a minute per key at most.
LAST_USED_RESOLUTION = timedelta(minutes=1)
# A playground session renews its key before this runs out; an abandoned one just expires.
PLAYGROUND_KEY_LIFETIME = timedelta(hours=1)
# Long enough to reach someone over a weekend; short enough that a forgotten link dies.
INVITATION_LIFETIME = timedelta(days=7)


@dataclass(frozen=True)
class ApiKeyCreated:
    """The new key's record and its plaintext, which is shown this once and never stored."""

    api_key: ApiKey
    plaintext: str


@dataclass(frozen=True)
class InvitationCreated:
    """The invitation and its token, which (in the link) is shown this once and never stored."""

    invitation: Invitation
    token: str


@transaction.atomic
def tenant_create(*, name: str, plan=None, is_active: bool = True, actor: User | None = None) -> Tenant:
    tenant = validated_save(Tenant(name=name, plan=plan, is_active=is_active))
    audit_record(
        actor=actor, action=AuditEntry.Action.TENANT_CREATE, target=tenant, detail={"plan": str(plan) if plan else None}
    )
    return tenant


@transaction.atomic
def user_create(
    *,
    username: str,
    password: str,
    role: str,
    tenant: Tenant | None = None,
    email: str = "",
    tenant_role: str = User.TenantRole.MEMBER,
) -> User:
    is_admin = role == User.Role.ADMIN
    user = User(
        username=username,
        email=email,
        role=role,
        tenant=tenant,
        tenant_role=tenant_role,
        # Admins read reports in the Django admin, so they get staff access; others do not.
        is_staff=is_admin,
        is_superuser=is_admin,
    )
    _validate_password(password, user)
    user.set_password(password)
    return validated_save(user)


@transaction.atomic
def user_set_password(*, user: User, password: str) -> User:
    _validate_password(password, user)
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    all_models: bool = True,
    allowed_model_names: Sequence[str] = (),
    expires_at: datetime | None = None,
    rate_limit_per_minute: int | None = None,
    max_concurrent_requests: int | None = None,
    monthly_spend_limit: Decimal | None = None,
    batch_priority: bool = False,
    created_by: User | None = None,
    purpose: str = ApiKey.Purpose.API,
) -> ApiKeyCreated:
    allowed_models = _allowed_models(all_models=all_models, names=allowed_model_names)
    if expires_at is not None and expires_at <= timezone.now():
        raise ValidationError({"expires_at": "The expiry must be in the future."})
    if ApiKey.objects.filter(tenant=tenant, name=name).exists():
        # Checked here (the constraint below still guards races) so the error names the field.
        raise ValidationError({"name": "This tenant already has a key with this name."})
    plaintext = generate_api_key()
    api_key = validated_save(
        ApiKey(
            tenant=tenant,
            name=name,
            purpose=purpose,
            prefix=visible_prefix(plaintext),
            key_hash=hash_api_key(plaintext),
            all_models=all_models,
            expires_at=expires_at,
            rate_limit_per_minute=rate_limit_per_minute,
            max_concurrent_requests=max_concurrent_requests,
            monthly_spend_limit=_spend_limit(monthly_spend_limit),
            batch_priority=batch_priority,
            created_by=created_by,
        )
    )
    api_key.allowed_models.set(allowed_models)
    if purpose == ApiKey.Purpose.API:  # playground session keys are the dashboard's own, one an hour
        audit_record(
            actor=created_by,
            action=AuditEntry.Action.API_KEY_CREATE,
            target=api_key,
            target_label=_key_label(api_key),
            detail=_key_detail(api_key, allowed_models),
        )
    return ApiKeyCreated(api_key=api_key, plaintext=plaintext)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey, actor: User | None = None) -> ApiKey:
    api_key.revoked = True
    api_key.save(update_fields=["revoked"])  # recorded by accounts.signals
    if api_key.purpose == ApiKey.Purpose.API:
        audit_record(
            actor=actor, action=AuditEntry.Action.API_KEY_REVOKE, target=api_key, target_label=_key_label(api_key)
        )
    return api_key


@transaction.atomic
def api_key_set_spend_limit(
    *, api_key: ApiKey, monthly_spend_limit: Decimal | None, actor: User | None = None
) -> ApiKey:
    """Set (or, with None, remove) the most the key may spend in a calendar month. The gateway
    checks it when each request's credit is held (billing.key_spend), so it applies from the next
    request, counting what the key already spent this month."""
    before = api_key.monthly_spend_limit
    api_key.monthly_spend_limit = _spend_limit(monthly_spend_limit)
    api_key.full_clean()
    api_key.save(update_fields=["monthly_spend_limit"])  # not the whole row: the gateway writes last_used_at
    audit_record(
        actor=actor,
        action=AuditEntry.Action.API_KEY_SPEND_LIMIT,
        target=api_key,
        target_label=_key_label(api_key),
        detail={"monthly_spend_limit": [_limit_text(before), _limit_text(api_key.monthly_spend_limit)]},
    )
    return api_key


@transaction.atomic
def api_key_update(
    *,
    api_key: ApiKey,
    name: str,
    all_models: bool,
    allowed_model_names: Sequence[str] = (),
    rate_limit_per_minute: int | None = None,
    max_concurrent_requests: int | None = None,
    monthly_spend_limit: Decimal | None = None,
    batch_priority: bool = False,
    actor: User | None = None,
) -> ApiKey:
    """Change what a key is called and what it may do, its priority class included; its secret
    (hash and prefix), tenant and expiry stay. The gateways' key caches hear of it through
    accounts.signals, so the new models and limits apply from the next request. One audit entry
    lists the fields that changed."""
    api_key = ApiKey.objects.select_for_update().select_related("tenant").get(pk=api_key.pk)
    if api_key.revoked:
        raise ValidationError("A revoked key cannot be edited.")
    allowed_models = _allowed_models(all_models=all_models, names=allowed_model_names)
    if ApiKey.objects.filter(tenant=api_key.tenant, name=name).exclude(pk=api_key.pk).exists():
        raise ValidationError({"name": "This tenant already has a key with this name."})
    before = _key_settings(api_key, list(api_key.allowed_models.all()))
    api_key.name = name
    api_key.all_models = all_models
    api_key.rate_limit_per_minute = rate_limit_per_minute
    api_key.max_concurrent_requests = max_concurrent_requests
    api_key.monthly_spend_limit = _spend_limit(monthly_spend_limit)
    api_key.batch_priority = batch_priority
    after = _key_settings(api_key, allowed_models)
    diff = changes(before, after)
    if not diff:
        return api_key
    api_key.full_clean()
    # Not the whole row: the gateway writes last_used_at.
    api_key.save(update_fields=[*_EDITABLE_KEY_FIELDS])
    api_key.allowed_models.set(allowed_models)
    audit_record(
        actor=actor,
        action=AuditEntry.Action.API_KEY_UPDATE,
        target=api_key,
        target_label=_key_label(api_key),
        detail=diff,
    )
    return api_key


_EDITABLE_KEY_FIELDS = (
    "name",
    "all_models",
    "rate_limit_per_minute",
    "max_concurrent_requests",
    "monthly_spend_limit",
    "batch_priority",
)


def _key_settings(api_key: ApiKey, allowed_models: list) -> dict:
    """What api_key_update may change, as its audit entry compares it."""
    return {
        "name": api_key.name,
        "models": ", ".join(sorted(m.public_name for m in allowed_models)) if not api_key.all_models else "all",
        "rate_limit_per_minute": api_key.rate_limit_per_minute,
        "max_concurrent_requests": api_key.max_concurrent_requests,
        "monthly_spend_limit": _limit_text(api_key.monthly_spend_limit),
        "batch_priority": api_key.batch_priority,
    }


def _limit_text(limit: Decimal | None) -> str:
    return "none" if limit is None else format_usd(limit)


def _spend_limit(amount: Decimal | None) -> Decimal | None:
    # Money as Decimal, as the ledger takes it: a float cannot hold cents exactly.
    if amount is None:
        return None
    if not isinstance(amount, Decimal) or not amount.is_finite() or amount < 0:
        raise ValidationError(
            {"monthly_spend_limit": f"The monthly spend limit must be an amount of at least 0; got {amount}."}
        )
    return amount


def _key_label(api_key: ApiKey) -> str:
    return f"{api_key.tenant.name}: {api_key.name} ({api_key.prefix}…)"


def _key_detail(api_key: ApiKey, allowed_models: list) -> dict:
    detail = {"models": ", ".join(m.public_name for m in allowed_models) if allowed_models else "all"}
    if api_key.expires_at is not None:
        detail["expires_at"] = api_key.expires_at
    if api_key.rate_limit_per_minute is not None:
        detail["rate_limit_per_minute"] = api_key.rate_limit_per_minute
    if api_key.max_concurrent_requests is not None:
        detail["max_concurrent_requests"] = api_key.max_concurrent_requests
    if api_key.monthly_spend_limit is not None:
        detail["monthly_spend_limit"] = _limit_text(api_key.monthly_spend_limit)
    if api_key.batch_priority:
        detail["batch_priority"] = True
    return detail


def playground_tenant(*, user: User) -> Tenant:
    """The tenant that pays for `user`'s playground requests: their own, or for operators and admins
    (who belong to none) settings.PLAYGROUND_STAFF_TENANT, created on first use, with no credit."""
    if user.tenant_id is not None:
        return user.tenant
    if user.role not in (User.Role.OPERATOR, User.Role.ADMIN):
        raise ValidationError("Only members of a tenant, operators and admins can use the playground.")
    name = settings.PLAYGROUND_STAFF_TENANT
    tenant = Tenant.objects.filter(name=name).first()
    if tenant is None:
        try:
            with transaction.atomic():
                tenant = tenant_create(name=name, actor=user)
        except (IntegrityError, ValidationError):  # created meanwhile by another session
            tenant = Tenant.objects.get(name=name)
    return tenant


def playground_key_create(*, user: User, lifetime: timedelta = PLAYGROUND_KEY_LIFETIME) -> ApiKeyCreated:
    """A short-lived key for one dashboard playground session, of the tenant that pays for it
    (`playground_tenant`).

    The playground calls the same /v1 gateway as API clients, so it needs a key like theirs:
    the tenant's limits and credit apply and its requests are billed alike. The key is hidden
    from the tenant's key list, expires on its own, and the session revokes it when it ends.
    """
    return api_key_create(
        tenant=playground_tenant(user=user),
        name=f"playground {user.username[:60]} {secrets.token_hex(6)}",
        expires_at=timezone.now() + lifetime,
        created_by=user,
        purpose=ApiKey.Purpose.PLAYGROUND,
    )


@transaction.atomic
def api_key_record_use(*, api_key_id: int, at: datetime) -> bool:
    """Set the key's `last_used_at` unless it was set less than a minute before `at`; True if written."""
    recent = Q(last_used_at__isnull=False) & Q(last_used_at__gt=at - LAST_USED_RESOLUTION)
    return ApiKey.objects.filter(pk=api_key_id).exclude(recent).update(last_used_at=at) == 1


def _validate_password(password: str, user: User) -> None:
    try:
        validate_password(password, user)
    except ValidationError as exc:  # named, so that forms show it beside the password
        raise ValidationError({"password": exc.messages}) from None


# --- Teams and invitations -----------------------------------------------------------------------


def may_manage_team(*, user: User, tenant: Tenant) -> bool:
    """Admins manage every tenant's team; a tenant's own admins manage theirs; nobody else."""
    if not (user.is_authenticated and user.is_active):
        return False
    return user.role == User.Role.ADMIN or (user.is_tenant_admin and user.tenant_id == tenant.pk)


def _require_team_manager(actor: User, tenant: Tenant) -> None:
    if not may_manage_team(user=actor, tenant=tenant):
        raise PermissionDenied("Only the tenant's admins (or a platform admin) manage its team.")


@transaction.atomic
def invitation_create(
    *,
    created_by: User,
    role: str,
    tenant: Tenant | None = None,
    tenant_role: str = User.TenantRole.MEMBER,
    note: str = "",
    lifetime: timedelta = INVITATION_LIFETIME,
) -> InvitationCreated:
    """An invitation to join `tenant` with `tenant_role`, or (tenant None, admins only) to join the
    staff as an operator or admin. PermissionDenied when `created_by` may not invite so."""
    if role == User.Role.TENANT_MEMBER:
        if tenant is None:
            raise ValidationError({"tenant": "Name the tenant the new member joins."})
        _require_team_manager(created_by, tenant)
        if not tenant.is_active:
            raise ValidationError({"tenant": f"{tenant.name} is deactivated; nobody can join it."})
    else:
        if created_by.role != User.Role.ADMIN or not created_by.is_active:
            raise PermissionDenied("Only admins invite operators and admins.")
        if tenant is not None:
            raise ValidationError({"tenant": "Operators and admins belong to no tenant."})
        tenant_role = User.TenantRole.MEMBER
    token = new_secret_token()
    invitation = validated_save(
        Invitation(
            token_hash=secret_hash(token),
            role=role,
            tenant=tenant,
            tenant_role=tenant_role,
            note=note.strip(),
            created_by=created_by,
            expires_at=timezone.now() + lifetime,
        )
    )
    audit_record(
        actor=created_by,
        action=AuditEntry.Action.INVITATION_CREATE,
        target=invitation,
        detail={"role": invitation.role_label, "expires_at": invitation.expires_at},
    )
    return InvitationCreated(invitation=invitation, token=token)


@transaction.atomic
def invitation_revoke(*, invitation: Invitation, actor: User) -> Invitation:
    if invitation.tenant_id is not None:
        _require_team_manager(actor, invitation.tenant)
    elif actor.role != User.Role.ADMIN:
        raise PermissionDenied("Only admins withdraw invitations of operators and admins.")
    invitation = Invitation.objects.select_for_update().get(pk=invitation.pk)
    if invitation.accepted_at is not None:
        raise ValidationError("This invitation has already been used; remove the member instead.")
    if not invitation.revoked:
        invitation.revoked = True
        invitation.save(update_fields=["revoked"])
        audit_record(actor=actor, action=AuditEntry.Action.INVITATION_REVOKE, target=invitation)
    return invitation


@transaction.atomic
def invitation_accept(*, token: str, username: str, password: str, email: str = "") -> User:
    """Create the invited person's login. The invitation is locked, so of two people racing with
    one link exactly one gets in; it is spent by the first success and never works again."""
    invitation = (
        Invitation.objects.select_for_update(of=("self",))
        .select_related("tenant")
        .filter(token_hash=secret_hash(token))
        .first()
    )
    if invitation is None:
        raise ValidationError("This invitation link is not valid.")
    refusal = invitation.refusal()
    if refusal:
        raise ValidationError(refusal)
    if User.objects.filter(username__iexact=username).exists():
        raise ValidationError({"username": "This username is taken; choose another."})
    user = user_create(
        username=username,
        password=password,
        role=invitation.role,
        tenant=invitation.tenant,
        tenant_role=invitation.tenant_role,
        email=email,
    )
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    audit_record(
        actor=user,
        action=AuditEntry.Action.INVITATION_ACCEPT,
        target=invitation,
        detail={"username": user.username, "role": invitation.role_label},
    )
    return user


@transaction.atomic
def member_set_tenant_role(*, member: User, tenant_role: str, actor: User) -> User:
    """Make a tenant member an admin of its team or a plain member; the last admin stays one."""
    if tenant_role not in User.TenantRole.values:
        raise ValidationError({"tenant_role": f"Unknown role {tenant_role!r}."})
    member = _locked_member(member, actor)
    before = member.tenant_role
    if before == tenant_role:
        return member
    if before == User.TenantRole.ADMIN:
        _require_another_admin(member)
    member.tenant_role = tenant_role
    member.save(update_fields=["tenant_role"])
    audit_record(
        actor=actor,
        action=AuditEntry.Action.MEMBER_ROLE,
        target=member,
        target_label=_member_label(member),
        detail={"role": [User.TenantRole(before).label, User.TenantRole(tenant_role).label]},
    )
    return member


@transaction.atomic
def member_remove(*, member: User, actor: User) -> User:
    """Take a member out of its tenant: the login is deactivated (its history keeps the name), so
    it cannot sign in again; the tenant's keys stay the tenant's. The last admin cannot go."""
    member = _locked_member(member, actor)
    if not member.is_active:
        return member
    if member.tenant_role == User.TenantRole.ADMIN:
        _require_another_admin(member)
    member.is_active = False
    member.save(update_fields=["is_active"])
    audit_record(actor=actor, action=AuditEntry.Action.MEMBER_REMOVE, target=member, target_label=_member_label(member))
    return member


def _locked_member(member: User, actor: User) -> User:
    """The member re-read under its tenant's row lock: changes to one team's admins are serialised,
    so two admins demoting each other at once cannot leave the team with none."""
    if member.role != User.Role.TENANT_MEMBER or member.tenant_id is None:
        raise ValidationError("Only members of a tenant have a team role.")
    tenant = Tenant.objects.select_for_update().get(pk=member.tenant_id)
    _require_team_manager(actor, tenant)
    return User.objects.select_related("tenant").get(pk=member.pk)


def _require_another_admin(member: User) -> None:
    others = User.objects.filter(
        tenant_id=member.tenant_id, role=User.Role.TENANT_MEMBER, is_active=True, tenant_role=User.TenantRole.ADMIN
    ).exclude(pk=member.pk)
    if not others.exists():
        raise ValidationError(
            f"{member.username} is the last admin of {member.tenant.name}: make another member an admin first."
        )


def _member_label(member: User) -> str:
    return f"{member.username} ({member.tenant.name})"


@functools.cache
def _redis(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)


@transaction.atomic
def api_key_changes_record(
    *, key_hashes: Sequence[str] = (), tenant_ids: Sequence[int] = (), plan_ids: Sequence[int] = ()
) -> None:
    """Record, in the caller's transaction, that these keys (or every key of these tenants or
    plans) changed, so that gateways drop their cached copies; announced after commit."""
    rows = (
        [ApiKeyChange(key_hash=h) for h in key_hashes]
        + [ApiKeyChange(tenant_id=t) for t in tenant_ids]
        + [ApiKeyChange(plan_id=p) for p in plan_ids]
    )
    if not rows:
        return
    ApiKeyChange.objects.bulk_create(rows)
    ApiKeyChange.objects.filter(changed_at__lt=Now() - API_KEY_CHANGE_RETENTION).delete()
    hints = list(key_hashes) + ([ALL_KEYS_CHANGED] if tenant_ids or plan_ids else [])
    transaction.on_commit(lambda: _publish_api_key_changes(hints))


def _publish_api_key_changes(hints: list[str]) -> None:
    if not settings.REDIS_URL:
        return  # one embedded process: its gateway polls the changes anyway
    try:
        client = _redis(settings.REDIS_URL)
        for hint in hints:
            client.publish(API_KEY_CHANGES_CHANNEL, hint)
    except Exception:  # recorded in the database: gateways see it at their next poll
        logger.warning("could not announce %d API key change(s)", len(hints), exc_info=True)


def _allowed_models(*, all_models: bool, names: Sequence[str]) -> list:
    if all_models:
        if names:
            raise ValidationError({"allowed_models": "Give a list of models or allow all models, not both."})
        return []
    if not names:
        raise ValidationError({"allowed_models": "A key limited to a list of models needs at least one model."})
    found = models_by_public_name(public_names=names)
    unknown = sorted(set(names) - found.keys())
    if unknown:
        raise ValidationError({"allowed_models": f"Unknown model(s): {', '.join(unknown)}."})
    return list(found.values())
