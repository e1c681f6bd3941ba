"""Reading the audit log: filtered newest first, and the choices its filters offer."""

from django.db.models import QuerySet

from controlplane.audit.models import AuditEntry


def audit_entries(*, action: str = "", actor: str = "") -> QuerySet[AuditEntry]:
    """Entries newest first, with their actors; `action` matches exactly, `actor` the username exactly."""
    entries = AuditEntry.objects.select_related("actor")
    if action:
        entries = entries.filter(action=action)
    if actor:
        entries = entries.filter(actor_label=actor)
    return entries


def audit_actor_labels() -> list[str]:
    """Everyone who appears in the log, for the actor filter."""
    return list(AuditEntry.objects.order_by("actor_label").values_list("actor_label", flat=True).distinct())
