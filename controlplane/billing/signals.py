"""A saved or deleted plan changes what its tenants' keys may do (rate and concurrency limits): it
is recorded for the gateways' key caches (`accounts.services.api_key_changes_record`), whoever
makes it: a service, the admin, a shell. As for keys and tenants (accounts/signals.py), creations
are not recorded, since nothing can have cached what did not exist."""

from django.db.models.signals import post_delete, post_save

from controlplane.accounts.services import api_key_changes_record
from controlplane.billing.models import Plan


def _plan_changed(sender, instance: Plan, created: bool = False, **kwargs) -> None:
    if not created:
        api_key_changes_record(plan_ids=[instance.pk])


def connect() -> None:
    post_save.connect(_plan_changed, sender=Plan, dispatch_uid="plan-saved")
    post_delete.connect(_plan_changed, sender=Plan, dispatch_uid="plan-deleted")
