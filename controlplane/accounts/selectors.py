"""Reads for tenants, users and API keys, including the key check the gateway relies on."""

from datetime import datetime, timedelta

from django.core.cache import caches
from django.db.models import Count, Q, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from controlplane.accounts.keys import KEY_SCHEME, hash_api_key
from controlplane.accounts.models import ApiKey, ApiKeyChange, Invitation, Tenant, User
from controlplane.tokens import secret_hash


class ApiKeyRejected(Exception):
    """The presented key cannot be used; `reason` says why in words safe to show the caller."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def api_key_authenticate(*, plaintext: str, now: datetime | None = None) -> ApiKey:
    """The usable key matching `plaintext`, found by its hash; raises ApiKeyRejected otherwise."""
    if not plaintext.startswith(KEY_SCHEME):
        raise ApiKeyRejected("Invalid API key.")
    try:
        api_key = ApiKey.objects.select_related("tenant__plan").get(key_hash=hash_api_key(plaintext))
    except ApiKey.DoesNotExist:
        raise ApiKeyRejected("Invalid API key.") from None
    return _usable(api_key, now)


def api_key_usable_by_id(*, key_id: int, now: datetime | None = None) -> ApiKey:
    """The key with id `key_id` if it is still usable (work it started going on without its
    plaintext); raises ApiKeyRejected otherwise, as `api_key_authenticate` would."""
    try:
        api_key = ApiKey.objects.select_related("tenant__plan").get(pk=key_id)
    except ApiKey.DoesNotExist:
        raise ApiKeyRejected("This API key has been deleted.") from None
    return _usable(api_key, now)


def _usable(api_key: ApiKey, now: datetime | None) -> ApiKey:
    if api_key.revoked:
        raise ApiKeyRejected("This API key has been revoked.")
    if api_key.is_expired(now or timezone.now()):
        raise ApiKeyRejected("This API key has expired.")
    if not api_key.tenant.is_active:
        raise ApiKeyRejected("This API key's tenant is deactivated.")
    return api_key


def api_key_allows_model(*, api_key: ApiKey, model) -> bool:
    if api_key.all_models:
        return True
    return api_key.allowed_models.filter(pk=model.pk).exists()


def api_key_allowed_model_ids(*, api_key: ApiKey) -> frozenset[int] | None:
    """The ids of the models the key may call, or None when it may call every model."""
    if api_key.all_models:
        return None
    return frozenset(api_key.allowed_models.values_list("pk", flat=True))


def api_keys_for_tenant(*, tenant: Tenant) -> QuerySet[ApiKey]:
    """The tenant's own API keys; playground session keys are the dashboard's, not listed."""
    return ApiKey.objects.filter(tenant=tenant, purpose=ApiKey.Purpose.API).prefetch_related("allowed_models")


def api_keys_usable_for_tenant(*, tenant: Tenant, now: datetime | None = None) -> list[ApiKey]:
    """The tenant's own keys that work now (not revoked, not expired), newest first."""
    now = now or timezone.now()
    keys = api_keys_for_tenant(tenant=tenant).filter(revoked=False).order_by("-created_at", "-pk")
    return [key for key in keys if not key.is_expired(now)]


def api_keys_unrevoked_for_tenant(*, tenant: Tenant) -> QuerySet[ApiKey]:
    """The tenant's own API keys that are not revoked (expired ones included: expiry is a time)."""
    return api_keys_for_tenant(tenant=tenant).filter(revoked=False)


def api_key_choices(*, tenant: Tenant | None) -> QuerySet[ApiKey]:
    """The tenant's own API keys by name, to filter its requests by; none without a tenant."""
    if tenant is None:
        return ApiKey.objects.none()
    return ApiKey.objects.filter(tenant=tenant, purpose=ApiKey.Purpose.API).order_by("name", "pk")


def tenants_by_name() -> QuerySet[Tenant]:
    """Every tenant with its plan, by name."""
    return Tenant.objects.select_related("plan").order_by("name")


def tenant_get_by_name(*, name: str) -> Tenant | None:
    return Tenant.objects.filter(name=name).first()


def user_get_by_username(*, username: str) -> User | None:
    return User.objects.filter(username=username).first()


def api_key_changes_recent(*, within: timedelta) -> list[tuple[int, str, int | None, int | None]]:
    """(id, key hash, tenant id, plan id) of the key changes of the last `within`, by the
    database's clock; one range scan of an index."""
    return list(
        ApiKeyChange.objects.filter(changed_at__gte=Now() - within).values_list(
            "id", "key_hash", "tenant_id", "plan_id"
        )
    )


def team_members(*, tenant: Tenant) -> QuerySet[User]:
    """The tenant's active members, admins first; removed members are deactivated, not listed."""
    return User.objects.filter(tenant=tenant, role=User.Role.TENANT_MEMBER, is_active=True).order_by(
        "tenant_role", "username"
    )


def staff_members() -> QuerySet[User]:
    """Active operators and admins."""
    return User.objects.filter(role__in=[User.Role.OPERATOR, User.Role.ADMIN], is_active=True).order_by(
        "role", "username"
    )


def invitations_open(*, tenant: Tenant | None, now: datetime | None = None) -> QuerySet[Invitation]:
    """Invitations still usable: of `tenant`, or of the staff when `tenant` is None."""
    open_ = Invitation.objects.filter(
        accepted_at__isnull=True, revoked=False, expires_at__gt=now or timezone.now()
    ).select_related("created_by")
    return open_.filter(tenant=tenant) if tenant is not None else open_.filter(tenant__isnull=True)


def invitations_of(*, tenant: Tenant | None) -> QuerySet[Invitation]:
    """Every invitation, open or not, of `tenant`, or of the staff when `tenant` is None."""
    invitations = Invitation.objects.all()
    return invitations.filter(tenant=tenant) if tenant is not None else invitations.filter(tenant__isnull=True)


def invitation_get_by_token(*, token: str) -> Invitation | None:
    return Invitation.objects.select_related("tenant").filter(token_hash=secret_hash(token)).first()


def tenants_with_member_counts() -> QuerySet[Tenant]:
    """Every tenant with `member_count` (active members) and its plan."""
    active = Q(members__is_active=True, members__role=User.Role.TENANT_MEMBER)
    return Tenant.objects.select_related("plan").annotate(member_count=Count("members", filter=active))


# Tenant names by id, for pages that show ids from live reports (a replica's tenants): cached, so
# that a page redrawn on every heartbeat reads no rows; a saved or deleted tenant drops its entry
# (accounts/signals.py), and the timeout bounds what a change made without its signal leaves. In
# the live cache, which every process shares (Redis, or files without it), so that a rename made
# in one process (the admin, a shell, a task) is seen by the pages another one serves.
_TENANT_NAME_KEY = "accounts:tenant-name:{}"
TENANT_NAME_CACHE_S = 3600


def tenant_names(*, tenant_ids) -> dict[int, str]:
    """{id: name} of the tenants among `tenant_ids` that exist: from the cache, the rest in one query."""
    ids = {int(tenant_id) for tenant_id in tenant_ids}
    if not ids:
        return {}
    cached = caches["live"].get_many([_TENANT_NAME_KEY.format(i) for i in ids])
    names = {i: cached[_TENANT_NAME_KEY.format(i)] for i in ids if _TENANT_NAME_KEY.format(i) in cached}
    missing = ids - names.keys()
    if missing:
        found = dict(Tenant.objects.filter(pk__in=missing).values_list("pk", "name"))
        caches["live"].set_many({_TENANT_NAME_KEY.format(i): name for i, name in found.items()}, TENANT_NAME_CACHE_S)
        names.update(found)
    return names


def tenant_name_forget(*, tenant_id: int) -> None:
    """Drop a tenant's cached name (it was renamed or deleted)."""
    caches["live"].delete(_TENANT_NAME_KEY.format(tenant_id))
