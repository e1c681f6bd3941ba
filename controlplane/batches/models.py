"""Files a tenant uploaded (their bytes in the storage folder), batches over them, and each batch's
lines with their outcome. A batch's progress lives in its lines' rows, so any process can pick a
batch up where a dead one left it."""

import secrets

from django.db import models
from django.db.models import Q

from controlplane.common.json_text import JSONTextField

# A batch's id, and so the request id of each of its lines ("<batch id>:<line number>").
BATCH_ID_PREFIX = "batch_"


def new_public_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def is_batch_request(request_id: str) -> bool:
    """Whether a request id in flight is a batch line's (batch work yields to interactive requests)."""
    return request_id.startswith(BATCH_ID_PREFIX)


class BatchFile(models.Model):
    """An uploaded (purpose "batch") or produced (output, errors) JSONL file."""

    class Purpose(models.TextChoices):
        BATCH = "batch", "Batch input"
        BATCH_OUTPUT = "batch_output", "Batch output"

    public_id = models.CharField(max_length=40, unique=True)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.BigIntegerField()
    lines = models.PositiveIntegerField(default=0)
    # Relative to settings.BATCH_STORAGE_DIR.
    storage_name = models.CharField(max_length=200)
    # Deleted by the tenant: its bytes are gone, the row stays for the batches that name it.
    deleted = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.public_id


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    ENDED = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)

    public_id = models.CharField(max_length=40, unique=True)
    tenant = models.ForeignKey("accounts.Tenant", on_delete=models.CASCADE, related_name="batches")
    api_key = models.ForeignKey("accounts.ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    input_file = models.ForeignKey(BatchFile, on_delete=models.PROTECT, related_name="batches")
    output_file = models.ForeignKey(BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    error_file = models.ForeignKey(BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    endpoint = models.CharField(max_length=40)
    model_name = models.CharField(max_length=200, blank=True)
    completion_window_s = models.PositiveIntegerField()
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.VALIDATING)
    # [{"code", "message", "param", "line"}]: why validation failed the batch.
    errors = models.JSONField(default=list, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)
    # Who works on the batch now, and until when (a runner that dies lets its lease run out).
    lease_owner = models.CharField(max_length=40, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"
        indexes = [models.Index(fields=["status", "lease_until"])]

    def __str__(self) -> str:
        return self.public_id

    @property
    def progress_percent(self) -> int:
        return int(100 * (self.completed + self.failed) / self.total) if self.total else 0


class BatchLine(models.Model):
    """One request of a batch. `request_id` is its usage record's key, made from the batch and the
    line's custom_id: the record's uniqueness is what charges a line at most once."""

    class Status(models.TextChoices):
        PENDING = "pending"
        COMPLETED = "completed"  # answered (the answer may be the replica's 400: see status_code)
        FAILED = "failed"  # no answer: replica unavailable, credit, expiry, cancellation

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    request_id = models.CharField(max_length=64, unique=True)
    body = JSONTextField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    response = JSONTextField(null=True, blank=True)
    error = JSONTextField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "line_number"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batchline_custom_id_unique_in_batch"),
            models.UniqueConstraint(fields=["batch", "line_number"], name="batchline_line_unique_in_batch"),
        ]
        indexes = [models.Index(fields=["batch", "status"], condition=Q(status="pending"), name="batchline_pending")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id}"
