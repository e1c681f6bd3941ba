"""Every saved change to a key or a tenant is recorded for the gateways' key caches
(`api_key_changes_record`), whoever makes it: a service, the admin, a shell. Receivers only call
that service; creations are not recorded, since nothing can have cached what did not exist.
A tenant's plan changes what its keys may do too: billing, which owns plans and comes after
accounts, records those through the same service (billing/signals.py). A saved or deleted tenant's
cached name is dropped too (selectors.tenant_names)."""

from django.db.models.signals import m2m_changed, post_delete, post_save

from controlplane.accounts.models import ApiKey, Tenant
from controlplane.accounts.selectors import tenant_name_forget
from controlplane.accounts.services import api_key_changes_record


def _key_saved(sender, instance: ApiKey, created: bool, **kwargs) -> None:
    if not created:
        api_key_changes_record(key_hashes=[instance.key_hash])


def _key_deleted(sender, instance: ApiKey, **kwargs) -> None:
    api_key_changes_record(key_hashes=[instance.key_hash])


def _allowed_models_changed(sender, instance, action: str, reverse: bool, pk_set, **kwargs) -> None:
    if not reverse:
        if action in ("post_add", "post_remove", "post_clear"):
            api_key_changes_record(key_hashes=[instance.key_hash])
        return
    # From a model's side: `pk_set` holds the keys, or for a clear, the keys it still has now.
    if action == "pre_clear":
        keys = instance.api_keys.all()
    elif action in ("post_add", "post_remove"):
        keys = ApiKey.objects.filter(pk__in=pk_set)
    else:
        return
    api_key_changes_record(key_hashes=list(keys.values_list("key_hash", flat=True)))


def _tenant_changed(sender, instance: Tenant, created: bool = False, **kwargs) -> None:
    tenant_name_forget(tenant_id=instance.pk)  # a new one too: its id may have a stale entry (a recreated database)
    if not created:
        api_key_changes_record(tenant_ids=[instance.pk])


def connect() -> None:
    post_save.connect(_key_saved, sender=ApiKey, dispatch_uid="api-key-saved")
    post_delete.connect(_key_deleted, sender=ApiKey, dispatch_uid="api-key-deleted")
    m2m_changed.connect(
        _allowed_models_changed, sender=ApiKey.allowed_models.through, dispatch_uid="api-key-models-changed"
    )
    post_save.connect(_tenant_changed, sender=Tenant, dispatch_uid="tenant-saved")
    post_delete.connect(_tenant_changed, sender=Tenant, dispatch_uid="tenant-deleted")
