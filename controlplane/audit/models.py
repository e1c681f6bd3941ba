"""One row per operator or admin action (or system action through the same services), and each change to
a tenant's keys, team and credits: append-only history."""

from django.conf import settings
from django.db import models


class AuditEntry(models.Model):
    class Action(models.TextChoices):
        MODEL_CREATE = "model.create", "Model added"
        MODEL_UPDATE = "model.update", "Model edited"
        MODEL_ENABLE = "model.enable", "Model enabled"
        MODEL_DISABLE = "model.disable", "Model disabled"
        MODEL_DELETE = "model.delete", "Model deleted"
        MODEL_MEASURE_QUALITY = "model.measure_quality", "Model's quality measurement asked for"
        DEPLOYMENT_CREATE = "deployment.create", "Deployment created"
        DEPLOYMENT_SCALE = "deployment.scale", "Deployment scaled"
        DEPLOYMENT_UPDATE = "deployment.update", "Deployment edited"
        DEPLOYMENT_RETRY = "deployment.retry", "Deployment retried now"
        REPLICA_LOAD = "replica.load", "Replica loaded"
        REPLICA_UNLOAD = "replica.unload", "Replica unloaded"
        REPLICA_MOVE = "replica.move", "Replica moved to another worker"
        WORKER_DRAIN = "worker.drain", "Worker drained"
        API_KEY_CREATE = "api_key.create", "API key created"
        API_KEY_REVOKE = "api_key.revoke", "API key revoked"
        API_KEY_SPEND_LIMIT = "api_key.spend_limit", "API key spend limit set"
        API_KEY_UPDATE = "api_key.update", "API key edited"
        TENANT_CREATE = "tenant.create", "Tenant created"
        CREDIT_GRANT = "credit.grant", "Credits granted"
        CREDIT_ADJUST = "credit.adjust", "Credits adjusted down"
        INVITATION_CREATE = "invitation.create", "Invitation made"
        INVITATION_REVOKE = "invitation.revoke", "Invitation withdrawn"
        INVITATION_ACCEPT = "invitation.accept", "Invitation accepted"
        MEMBER_ROLE = "member.role", "Member's role changed"
        MEMBER_REMOVE = "member.remove", "Member removed"

    # Kept when the user is deleted: the label below still says who it was.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="audit_entries",
    )
    # The username at the time, or "system" for actions no person took (seeding, automation).
    actor_label = models.CharField(max_length=150)
    action = models.CharField(max_length=40, choices=Action.choices)
    # e.g. "catalog.model" and its primary key; the label is the name it had then.
    target_type = models.CharField(max_length=100)
    target_id = models.CharField(max_length=64)
    target_label = models.CharField(max_length=200)
    # What changed: {"field": [before, after]} for edits, or the action's parameters.
    detail = models.JSONField(default=dict, blank=True)
    # The client address of the web request that did it (through trusted proxies: see
    # common.client_address); empty for actions outside a request (Celery, management commands).
    source_address = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["action", "-created_at"]), models.Index(fields=["actor_label", "-created_at"])]

    def describe(self) -> str:
        """The detail in one line: "field: before → after" for changes, "key: value" otherwise."""
        parts = []
        for key, value in self.detail.items():
            if isinstance(value, list) and len(value) == 2:
                parts.append(f"{key}: {value[0]} → {value[1]}")
            else:
                parts.append(f"{key}: {value}")
        return "; ".join(parts)

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target_label}"
