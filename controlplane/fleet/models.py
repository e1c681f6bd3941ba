"""GPU worker hosts, their GPUs, and replicas with their lifecycle state machine."""

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone


def validate_endpoint_url(value: str) -> None:
    # Not Django's URLValidator: it rejects single-label hosts such as `gpuworker`, which is
    # exactly what a worker is called on a docker-compose network.
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError("Enter an http:// or https:// URL with a host, e.g. http://gpuworker:8001.")


class Worker(models.Model):
    class State(models.TextChoices):
        ONLINE = "online", "Online"
        OFFLINE = "offline", "Offline"

    host = models.CharField(max_length=255)
    # Each worker consumes its own Celery queue, so control tasks reach exactly that host.
    queue_name = models.CharField(
        max_length=100,
        unique=True,
        validators=[RegexValidator(r"^[A-Za-z0-9._-]+$", "Use letters, digits and . _ - only.")],
    )
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    state = models.CharField(max_length=20, choices=State.choices, default=State.ONLINE)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["host", "queue_name"]

    def __str__(self) -> str:
        return f"{self.host} ({self.queue_name})"


class Gpu(models.Model):
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="CUDA device index on the worker host.")
    name = models.CharField(max_length=100)
    memory_total_bytes = models.PositiveBigIntegerField()

    class Meta:
        ordering = ["worker", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "index"], name="gpu_unique_index_per_worker",
                violation_error_message="This worker already has a GPU with this index.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.worker.host} GPU {self.index} ({self.name})"


class Replica(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        LOADING = "loading", "Loading"
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        STOPPED = "stopped", "Stopped"
        FAILED = "failed", "Failed"

    # pending → loading → ready → draining → stopped, and failed from any live state. A replica
    # still pending can be stopped outright; one still loading is unloaded by draining it.
    TRANSITIONS: dict[str, frozenset[str]] = {
        State.PENDING: frozenset({State.LOADING, State.STOPPED, State.FAILED}),
        State.LOADING: frozenset({State.READY, State.DRAINING, State.FAILED}),
        State.READY: frozenset({State.DRAINING, State.FAILED}),
        State.DRAINING: frozenset({State.STOPPED, State.FAILED}),
        State.STOPPED: frozenset(),
        State.FAILED: frozenset(),
    }
    LIVE_STATES = (State.PENDING, State.LOADING, State.READY, State.DRAINING)

    deployment = models.ForeignKey("catalog.Deployment", on_delete=models.CASCADE, related_name="replicas")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="replicas")
    gpu = models.ForeignKey(
        Gpu, on_delete=models.CASCADE, null=True, blank=True, related_name="replicas",
        help_text="Empty for a replica running on the worker's CPU.",
    )
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    endpoint_url = models.CharField(
        max_length=300, blank=True, validators=[validate_endpoint_url],
        help_text="The worker's internal OpenAI-compatible API for this replica.",
    )
    last_error = models.TextField(blank=True)
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["deployment", "state"])]

    def __str__(self) -> str:
        return f"{self.deployment.model.public_name} on {self.worker.host} [{self.state}]"

    def clean(self) -> None:
        super().clean()
        if self.gpu_id is not None and self.worker_id is not None and self.gpu.worker_id != self.worker_id:
            raise ValidationError({"gpu": "The GPU must belong to the replica's worker."})
        if self.state == self.State.READY and not self.endpoint_url:
            raise ValidationError({"endpoint_url": "A ready replica needs the endpoint URL it serves on."})
