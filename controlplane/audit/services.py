"""Writing the audit log. Called inside the services that act (catalog, fleet, accounts, billing),
in their transaction, so an action is recorded exactly when it commits, whoever called the service."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models

from controlplane.audit.models import AuditEntry

SYSTEM_ACTOR = "system"

# The client address of the request being served. Services take the acting user, not the request,
# so the address reaches audit_record this way (set by audit.middleware around each request).
_source_address: ContextVar[str | None] = ContextVar("audit_source_address", default=None)


@contextmanager
def audit_source(address: str | None) -> Iterator[None]:
    """Entries recorded inside this block were done from `address`."""
    token = _source_address.set(address)
    try:
        yield
    finally:
        _source_address.reset(token)


def _json_safe(detail: dict[str, Any]) -> dict[str, Any]:
    # Decimals, dates and the like become strings, as they would in any JSON export of the log.
    return json.loads(json.dumps(detail, cls=DjangoJSONEncoder))


def audit_record(
    *, actor, action: str, target: models.Model, detail: dict[str, Any] | None = None, target_label: str | None = None
) -> AuditEntry:
    """Record that `actor` (a user, or None for the system) did `action` to `target`, named
    `target_label` (default: str(target)) as it was then, from the address audit_source set."""
    if action not in AuditEntry.Action.values:
        raise ValueError(f"Unknown audit action {action!r}; add it to AuditEntry.Action.")
    if target.pk is None:
        raise ValueError("Audit the target after it is saved: it has no primary key yet.")
    person = actor if actor is not None and getattr(actor, "is_authenticated", False) else None
    return AuditEntry.objects.create(
        actor=person,
        actor_label=person.get_username() if person is not None else SYSTEM_ACTOR,
        action=action,
        target_type=target._meta.label_lower,
        target_id=str(target.pk),
        target_label=(target_label if target_label is not None else str(target))[:200],
        detail=_json_safe(detail or {}),
        source_address=_source_address.get(),
    )


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{"field": [before, after]} for the fields whose value differs."""
    return {name: [before.get(name), value] for name, value in after.items() if before.get(name) != value}
