"""GPU worker hosts, their GPUs, and replicas with their lifecycle state machine."""

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from controlplane.fleet.placement import held_gpu_indexes


def validate_endpoint_url(value: str) -> None:
    # Not Django's URLValidator: it rejects single-label hosts such as `gpuworker`, which is
    # exactly what a worker is called on a docker-compose network.
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValidationError("Enter an http:// or https:// URL with a host, e.g. http://gpuworker:8001.")


class Worker(models.Model):
    class State(models.TextChoices):
        ONLINE = "online", "Online"
        # Finishing its replicas before going away: no new placements.
        DRAINING = "draining", "Draining"
        # Went silent unexpectedly: its replicas were failed and replaced elsewhere.
        LOST = "lost", "Lost"
        # Gone on purpose (silent after draining) or lost for a long time.
        OFFLINE = "offline", "Offline"

    class Device(models.TextChoices):
        CUDA = "cuda", "CUDA"
        CPU = "cpu", "CPU"

    # Workers register themselves by name (idempotently), so a restarted daemon finds its row again.
    name = models.CharField(
        max_length=80,
        unique=True,
        validators=[RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "Use letters, digits and . _ - only.")],
    )
    # Each worker consumes its own Celery queue, so control tasks reach exactly that host.
    queue_name = models.CharField(max_length=100, unique=True)
    advertise_host = models.CharField(
        max_length=255, help_text="Host name or address the replicas' endpoints are reached at."
    )
    device = models.CharField(max_length=10, choices=Device.choices, default=Device.CUDA)
    cpu_memory_total_bytes = models.PositiveBigIntegerField(default=0)
    cpu_cores = models.PositiveIntegerField(default=0)
    version = models.CharField(max_length=50, blank=True)
    # Where the daemon looks for checkpoints (--model-root) and the checkpoint directories it found
    # there, as last reported: the catalog checks a model's weight path against them. A worker
    # with no roots reports nothing, and its paths are simply not checked.
    model_roots = models.JSONField(default=list, blank=True)
    model_paths = models.JSONField(default=list, blank=True)
    # {path: quantization label} for the quantized checkpoints among model_paths (the catalog's
    # Model.Quantization values), as last reported.
    model_quantization = models.JSONField(default=dict, blank=True)
    # {path: what the daemon read there} (gpuworker.contract.heartbeat.CheckpointReport.to_json) for
    # the checkpoints among model_paths, as last reported: the catalog fills a new model from it.
    model_checkpoints = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.ONLINE)
    # Written on registration and state changes only; the latest heartbeat lives in the live cache.
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"


class Gpu(models.Model):
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="CUDA device index on the worker host.")
    name = models.CharField(max_length=100)
    memory_total_bytes = models.PositiveBigIntegerField()
    # A GPU the worker stopped reporting keeps its row (its replicas' history points at it) but
    # takes no new replicas.
    present = models.BooleanField(default=True)

    class Meta:
        ordering = ["worker", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "index"],
                name="gpu_unique_index_per_worker",
                violation_error_message="This worker already has a GPU with this index.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.worker.name} GPU {self.index} ({self.name})"


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
    # Live and meant to stay: what counts toward a deployment's desired replicas.
    ACTIVE_STATES = (State.PENDING, State.LOADING, State.READY)

    class Failure(models.TextChoices):
        NONE = "", "None"
        # The worker reported the load failing (or the replica dying before it was ready): retried
        # on that worker with backoff (LoadBackoff), other workers first.
        LOAD = "load", "Load failed"
        # The worker reported it failing after it was ready (the server process died, say).
        CRASHED = "crashed", "Crashed"
        WORKER_LOST = "worker_lost", "Worker lost"
        # The worker never confirmed the load message (lost in transit): re-placed.
        NOT_ACKNOWLEDGED = "not_acknowledged", "Not acknowledged"
        # The worker stopped reporting a replica it had been running.
        VANISHED = "vanished", "Vanished"

    deployment = models.ForeignKey("catalog.Deployment", on_delete=models.CASCADE, related_name="replicas")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="replicas")
    gpu = models.ForeignKey(
        Gpu,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="replicas",
        help_text="Empty for a replica running on the worker's CPU; its first GPU when split over several.",
    )
    # The model's tensor_parallel_size when the replica was placed: it holds the GPUs with indexes
    # gpu.index .. gpu.index + tensor_parallel_size - 1 of its worker (placement.held_gpu_indexes).
    tensor_parallel_size = models.PositiveSmallIntegerField(default=1, validators=[MinValueValidator(1)])
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    endpoint_url = models.CharField(
        max_length=300,
        blank=True,
        validators=[validate_endpoint_url],
        help_text="The worker's internal OpenAI-compatible API for this replica.",
    )
    last_error = models.TextField(blank=True)
    failure = models.CharField(max_length=20, choices=Failure.choices, blank=True, default=Failure.NONE)
    state_changed_at = models.DateTimeField(default=timezone.now)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["deployment", "state"]), models.Index(fields=["worker", "state"])]

    def __str__(self) -> str:
        return f"{self.deployment.model.public_name} on {self.worker.name} [{self.state}]"

    @property
    def gpu_indexes(self) -> list[int]:
        """The indexes of the GPUs it holds (none on a worker's CPU)."""
        return held_gpu_indexes(
            first_index=self.gpu.index if self.gpu_id is not None else None,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @property
    def gpus_label(self) -> str:
        """Where on its worker it runs, as the pages say it: "GPU 0", "GPUs 0–1", or "" (the CPU)."""
        indexes = self.gpu_indexes
        if not indexes:
            return ""
        return f"GPU {indexes[0]}" if len(indexes) == 1 else f"GPUs {indexes[0]}–{indexes[-1]}"

    def clean(self) -> None:
        super().clean()
        if self.gpu_id is not None and self.worker_id is not None and self.gpu.worker_id != self.worker_id:
            raise ValidationError({"gpu": "The GPU must belong to the replica's worker."})
        if self.state == self.State.READY and not self.endpoint_url:
            raise ValidationError({"endpoint_url": "A ready replica needs the endpoint URL it serves on."})


class AutoscaleDecision(models.Model):
    """The autoscaler's latest decision for one deployment, holds included (replaced every tick):
    what the fleet page shows beside the deployment. Changes also land in the audit log."""

    class Action(models.TextChoices):
        UP = "up", "Scale up"
        DOWN = "down", "Scale down"
        HOLD = "hold", "Hold"

    deployment = models.OneToOneField(
        "catalog.Deployment", on_delete=models.CASCADE, primary_key=True, related_name="autoscale_decision"
    )
    action = models.CharField(max_length=10, choices=Action.choices)
    desired_replicas = models.PositiveIntegerField()
    reason = models.CharField(max_length=500)
    # Every figure the decision read (autoscaling.Decision.inputs).
    inputs = models.JSONField(default=dict, blank=True)
    decided_at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.action} to {self.desired_replicas} ({self.reason})"


class LoadBackoff(models.Model):
    """Failed loads in a row of one deployment on one worker, and when reconcile may try that
    worker again (FLEET_LOAD_RETRY_*: doubling, capped). Written with the failure itself, deleted
    when a replica there becomes ready or an operator asks to retry now. In the database, so a
    restarted control plane carries on with the schedule instead of forgetting or freezing it."""

    deployment = models.ForeignKey("catalog.Deployment", on_delete=models.CASCADE, related_name="load_backoffs")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="load_backoffs")
    consecutive_failures = models.PositiveIntegerField(default=0)
    first_failed_at = models.DateTimeField()
    last_failed_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    # The latest failure's whole error; its first line is the cause (fleet.backoff.error_cause).
    last_error = models.TextField(blank=True)

    class Meta:
        ordering = ["next_attempt_at", "pk"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "worker"], name="load_backoff_unique_per_worker"),
        ]

    def __str__(self) -> str:
        return (
            f"{self.deployment_id} on {self.worker_id}: {self.consecutive_failures} failed, next {self.next_attempt_at}"
        )


class RebalanceMove(models.Model):
    """One replica of a deployment moved off a worker holding more than one of them
    (fleet.rebalance): `replica` started on `to_worker` first, and only once it is ready one ready
    replica on `from_worker` is drained (`drained_replica`). One move in progress per deployment."""

    class State(models.TextChoices):
        MOVING = "moving", "Moving"
        MOVED = "moved", "Moved"
        # The replacement failed or was stopped before it was ready: the crowded worker keeps its replicas.
        FAILED = "failed", "Replacement failed"
        # The crowded worker no longer held a replica to spare (lost, or an operator unloaded one).
        ABANDONED = "abandoned", "Abandoned"

    deployment = models.ForeignKey("catalog.Deployment", on_delete=models.CASCADE, related_name="rebalance_moves")
    from_worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="+")
    to_worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="+")
    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="+")
    drained_replica = models.ForeignKey(Replica, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    state = models.CharField(max_length=20, choices=State.choices, default=State.MOVING)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["deployment"], condition=models.Q(state="moving"), name="rebalance_move_one_at_a_time"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.from_worker_id} -> {self.to_worker_id} ({self.state})"


class PlacementReport(models.Model):
    """The last reconcile's placement outcome for a deployment: how many replicas it could not
    place and why (what was needed, what was free where), for the operators' pages."""

    deployment = models.OneToOneField("catalog.Deployment", on_delete=models.CASCADE, related_name="placement_report")
    unplaced = models.PositiveIntegerField(default=0)
    reason = models.TextField(blank=True)
    at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.deployment_id}: {self.unplaced} unplaced"


class QualityMeasurement(models.Model):
    """A perplexity measurement of a catalog model that an operator asked a worker for: the worker
    runs the quality command (gpuworker/daemon/quality_runs.py) and reports back; a report it
    returns is recorded on the model like one recorded by hand (catalog.services.model_record_perplexity)."""

    class State(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    IN_PROGRESS = (State.QUEUED, State.RUNNING)

    model = models.ForeignKey("catalog.Model", on_delete=models.CASCADE, related_name="quality_measurements")
    worker = models.ForeignKey(Worker, on_delete=models.CASCADE, related_name="quality_measurements")
    # The GPU the measurement runs on; None: the worker's CPU.
    gpu_index = models.PositiveSmallIntegerField(null=True, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.QUEUED)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.model} on {self.worker}: {self.state}"

    @property
    def device_label(self) -> str:
        """Where it runs, as pages and the audit log name it: "GPU 1", or "CPU"."""
        return f"GPU {self.gpu_index}" if self.gpu_index is not None else "CPU"

    @property
    def finished_at(self):
        """When it ended (done or failed); None while queued or running."""
        return None if self.state in self.IN_PROGRESS else self.state_changed_at
