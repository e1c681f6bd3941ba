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
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from controlplane.accounts.keys import generate_api_key, hash_api_key, visible_prefix
from controlplane.accounts.models import ApiKey, ApiKeyChange, Tenant, User
from controlplane.catalog.selectors import models_by_public_name
from controlplane.common.services import validated_save

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


@dataclass(frozen=True)
class ApiKeyCreated:
    """The new key's record and its plaintext, which is shown this once and never stored."""

    api_key: ApiKey
    plaintext: str


@transaction.atomic
def tenant_create(*, name: str, plan=None, is_active: bool = True) -> Tenant:
    return validated_save(Tenant(name=name, plan=plan, is_active=is_active))


@transaction.atomic
def user_create(
    *, username: str, password: str, role: str, tenant: Tenant | None = None, email: str = ""
) -> User:
    is_admin = role == User.Role.ADMIN
    user = User(
        username=username, email=email, role=role, tenant=tenant,
        # Admins read reports in the Django admin, so they get staff access; others do not.
        is_staff=is_admin, is_superuser=is_admin,
    )
    validate_password(password, user)
    user.set_password(password)
    return validated_save(user)


@transaction.atomic
def user_set_password(*, user: User, password: str) -> User:
    validate_password(password, user)
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
    api_key = validated_save(ApiKey(
        tenant=tenant, name=name, purpose=purpose, prefix=visible_prefix(plaintext),
        key_hash=hash_api_key(plaintext), all_models=all_models, expires_at=expires_at,
        rate_limit_per_minute=rate_limit_per_minute, max_concurrent_requests=max_concurrent_requests,
        monthly_spend_limit=_spend_limit(monthly_spend_limit), created_by=created_by,
    ))
    api_key.allowed_models.set(allowed_models)
    return ApiKeyCreated(api_key=api_key, plaintext=plaintext)


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    api_key.revoked = True
    api_key.save(update_fields=["revoked"])  # recorded by accounts.signals
    return api_key


@transaction.atomic
def api_key_set_spend_limit(*, api_key: ApiKey, monthly_spend_limit: Decimal | None) -> ApiKey:
    """Set (or, with None, remove) the most the key may spend in a calendar month. The gateway
    checks it when each request's credit is held (billing.key_spend), so it applies from the next
    request, counting what the key already spent this month."""
    api_key.monthly_spend_limit = _spend_limit(monthly_spend_limit)
    api_key.full_clean()
    api_key.save(update_fields=["monthly_spend_limit"])  # not the whole row: the gateway writes last_used_at
    return api_key


def _spend_limit(amount: Decimal | None) -> Decimal | None:
    # Money as Decimal, as the ledger takes it: a float cannot hold cents exactly.
    if amount is None:
        return None
    if not isinstance(amount, Decimal) or not amount.is_finite() or amount < 0:
        raise ValidationError({"monthly_spend_limit": f"The monthly spend limit must be an amount of at least 0; "
                                                      f"got {amount}."})
    return amount


def playground_key_create(*, user: User, lifetime: timedelta = PLAYGROUND_KEY_LIFETIME) -> ApiKeyCreated:
    """A short-lived key for one dashboard playground session of `user`'s tenant.

    The playground calls the same /v1 gateway as API clients, so it needs a key like theirs:
    the tenant's limits and credit apply and its requests are billed alike. The key is hidden
    from the tenant's key list, expires on its own, and the session revokes it when it ends.
    """
    if user.tenant_id is None:
        raise ValidationError("Only members of a tenant can use the playground.")
    return api_key_create(
        tenant=user.tenant, name=f"playground {user.username[:60]} {secrets.token_hex(6)}",
        expires_at=timezone.now() + lifetime, created_by=user, purpose=ApiKey.Purpose.PLAYGROUND,
    )


@transaction.atomic
def api_key_record_use(*, api_key_id: int, at: datetime) -> bool:
    """Set the key's `last_used_at` unless it was set less than a minute before `at`; True if written."""
    recent = Q(last_used_at__isnull=False) & Q(last_used_at__gt=at - LAST_USED_RESOLUTION)
    return ApiKey.objects.filter(pk=api_key_id).exclude(recent).update(last_used_at=at) == 1


@functools.cache
def _redis(url: str):
    import redis

    return redis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)


@transaction.atomic
def api_key_changes_record(*, key_hashes: Sequence[str] = (), tenant_ids: Sequence[int] = (),
                           plan_ids: Sequence[int] = ()) -> None:
    """Record, in the caller's transaction, that these keys (or every key of these tenants or
    plans) changed, so that gateways drop their cached copies; announced after commit."""
    rows = ([ApiKeyChange(key_hash=h) for h in key_hashes] + [ApiKeyChange(tenant_id=t) for t in tenant_ids]
            + [ApiKeyChange(plan_id=p) for p in plan_ids])
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
            raise ValidationError(
                {"allowed_models": "Give a list of models or allow all models, not both."}
            )
        return []
    if not names:
        raise ValidationError(
            {"allowed_models": "A key limited to a list of models needs at least one model."}
        )
    found = models_by_public_name(public_names=names)
    unknown = sorted(set(names) - found.keys())
    if unknown:
        raise ValidationError({"allowed_models": f"Unknown model(s): {', '.join(unknown)}."})
    return list(found.values())
