"""Models tenants can call (by public name) and each model's deployment (desired replicas)."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from gpuworker.contract.placement import MAX_TENSOR_PARALLEL_SIZE, UNSPLIT_QUANTIZATIONS
from gpuworker.contract.tasks import MAX_MODEL_LEN


class Model(models.Model):
    class Kind(models.TextChoices):
        CHAT = "chat", "Chat"
        COMPLETION = "completion", "Completion"
        EMBEDDING = "embedding", "Embedding"
        VISION = "vision", "Vision (chat with images)"

    # The name clients send in `model`; OpenAI clients accept letters, digits and . _ : / -.
    public_name = models.CharField(
        max_length=100,
        unique=True,
        validators=[
            RegexValidator(
                r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
                "Use letters, digits and . _ : / - only, starting with a letter or digit.",
            )
        ],
    )

    # The labels gpuworker's QuantConfig.label gives (the control plane imports nothing of the worker's).
    class Quantization(models.TextChoices):
        NONE = "", "None (bf16/fp16)"
        FP8 = "fp8", "FP8"
        INT8 = "int8", "INT8 W8A8"
        AWQ_INT4 = "awq-int4", "AWQ INT4"
        GPTQ_INT4 = "gptq-int4", "GPTQ INT4"

    family = models.CharField(max_length=50, help_text="Architecture family, e.g. llama.")
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.CHAT)
    # A vision model's limits on a chat request's images: the gateway refuses more images or bytes
    # before routing, and its replicas load with all three (pixels need the image's header).
    max_images_per_request = models.PositiveSmallIntegerField(
        default=16,
        validators=[MinValueValidator(1), MaxValueValidator(256)],
        help_text="Images one chat request may carry (vision models).",
    )
    max_image_bytes = models.PositiveIntegerField(
        default=20 << 20,
        validators=[MinValueValidator(1)],
        help_text="Largest image a request may carry, in bytes (vision models).",
    )
    max_image_pixels = models.PositiveIntegerField(
        default=8192 * 8192,
        validators=[MinValueValidator(1)],
        help_text="Most pixels (width x height) an image may have; the replica refuses larger ones from "
        "their header, before decoding (vision models).",
    )
    low_detail_pixels = models.PositiveIntegerField(
        default=512 * 512,
        validators=[MinValueValidator(1)],
        help_text='Most pixels an image sent with "detail": "low" keeps: the replica scales it down to them '
        "before the model's processor, so it fills fewer tokens (vision models).",
    )
    weights_path = models.CharField(
        max_length=500, help_text="Directory on the worker hosts holding the weights (Hugging Face layout)."
    )
    # The checkpoint's own context (its config.json's max_position_embeddings, as workers report it).
    context_length = models.PositiveIntegerField(
        validators=[MinValueValidator(1)],
        help_text="The checkpoint's context in tokens (its max_position_embeddings).",
    )
    # What replicas serve (their --max-model-len) where it differs from the checkpoint's context:
    # shorter to keep the KV cache small, longer only with allow_long_context.
    max_model_len = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_MODEL_LEN)],
        help_text="Tokens a replica serves (prompt plus output); empty: the context length.",
    )
    allow_long_context = models.BooleanField(
        default=False,
        help_text="Serve a max model length past the checkpoint's context: its rotary table is extended, "
        "and quality there is untested.",
    )
    parameter_count = models.PositiveBigIntegerField(validators=[MinValueValidator(1)])
    quantization = models.CharField(
        max_length=20,
        choices=Quantization.choices,
        default=Quantization.NONE,
        blank=True,
        help_text="How the served weights are quantized: as the checkpoint stores them (its config.json's "
        "quantization_config), or FP8 when quantized at load.",
    )

    # The values gpuworker's contract.tasks.LOAD_QUANTIZATIONS names.
    class LoadQuantization(models.TextChoices):
        NONE = "", "As stored"
        FP8 = "fp8", "FP8 at load"

    load_quantization = models.CharField(
        max_length=20,
        choices=LoadQuantization.choices,
        default=LoadQuantization.NONE,
        blank=True,
        help_text="Quantize a float checkpoint's weights as a replica loads them: FP8 at load serves the "
        "checkpoint in FP8 (its quantization then reads FP8).",
    )
    gpu_memory_bytes = models.PositiveBigIntegerField(
        validators=[MinValueValidator(1)],
        help_text="Estimated GPU memory a replica needs: weights plus a working KV cache.",
    )
    # A replica's GPUs: it runs split over this many GPUs of one worker (tensor parallel), each
    # holding its share of gpu_memory_bytes. The model's heads (and experts) must divide by it;
    # the catalog does not know them, so a size that does not divide fails the load, saying why.
    tensor_parallel_size = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TENSOR_PARALLEL_SIZE)],
        help_text="GPUs of one worker a replica is split over (tensor parallel); 1: one GPU.",
    )

    class ExpertParallel(models.TextChoices):
        # The values gpuworker's contract.tasks.EXPERT_PARALLEL_MODES names.
        ALL_REDUCE = "all_reduce", "All-reduce (every GPU on every token)"
        ALL_TO_ALL = "all_to_all", "All-to-all (tokens dispatched to their experts' GPUs)"

    expert_parallel = models.CharField(
        max_length=20,
        choices=ExpertParallel.choices,
        default=ExpertParallel.ALL_REDUCE,
        help_text="How a mixture-of-experts model split over several GPUs joins its experts.",
    )
    price_tier = models.ForeignKey("billing.PriceTier", on_delete=models.PROTECT, related_name="models")
    # The quality check: perplexity on the worker's fixed evaluation text (gpuworker/quality), as the
    # worker's command measured it, and the unquantized model it is compared with.
    base_model = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="quantized_models",
        help_text="The unquantized model this one is a quantization of: its perplexity is the reference.",
    )
    perplexity = models.FloatField(null=True, blank=True, editable=False)
    perplexity_tokens = models.PositiveIntegerField(null=True, blank=True, editable=False)
    perplexity_window = models.PositiveIntegerField(null=True, blank=True, editable=False)
    perplexity_text_sha256 = models.CharField(max_length=64, blank=True, editable=False)
    perplexity_measured_at = models.DateTimeField(null=True, blank=True, editable=False)
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["public_name"]

    def __str__(self) -> str:
        return self.public_name

    @property
    def served_context_length(self) -> int:
        """Tokens a replica of this model takes (prompt plus output): max_model_len where set
        (SERVED_CONTEXT_LENGTH in a query)."""
        return self.max_model_len or self.context_length

    def clean(self) -> None:
        self._clean_context()
        if self.tensor_parallel_size > 1 and self.quantization in UNSPLIT_QUANTIZATIONS:
            raise ValidationError(
                {
                    "tensor_parallel_size": f"A {self.get_quantization_display()} checkpoint runs on one GPU: its "
                    f"packed INT4 weights and per-group scales are not split over GPUs (FP8 and float checkpoints "
                    f"split). "
                    f"Set tensor_parallel_size to 1."
                }
            )
        if self.load_quantization and self.quantization != self.load_quantization:
            raise ValidationError(
                {
                    "load_quantization": f"{self.get_load_quantization_display()} serves FP8 weights, so the "
                    f"quantization must be FP8, not {self.get_quantization_display()}; a checkpoint stored "
                    f"quantized cannot be quantized again at load."
                }
            )
        base = self.base_model
        if base is None:
            return
        if base.pk == self.pk:
            raise ValidationError({"base_model": "A model cannot be its own base model."})
        if base.quantization != self.Quantization.NONE:
            raise ValidationError(
                {"base_model": f"The base model must be unquantized; {base.public_name} is {base.quantization}."}
            )

    def _clean_context(self) -> None:
        # The replica refuses a max_model_len past the checkpoint's positions without the flag
        # (engine.context_length): refused here, where the operator can fix it.
        if self.max_model_len and self.context_length and self.max_model_len > self.context_length:
            if not self.allow_long_context:
                raise ValidationError(
                    {
                        "max_model_len": f"{self.max_model_len} tokens is past the checkpoint's context of "
                        f"{self.context_length}: allow long context to serve past it, or lower it."
                    }
                )


# A vision model's image limits (other kinds ignore them): edited together, grouped on the catalog form.
IMAGE_LIMIT_FIELDS = ("max_images_per_request", "max_image_bytes", "max_image_pixels", "low_detail_pixels")


# Model.served_context_length, for a query's values.
SERVED_CONTEXT_LENGTH = Coalesce("max_model_len", "context_length")


# New deployments take the autoscaling defaults in force when they are created (settings.py).
def default_target_concurrency() -> int:
    return settings.AUTOSCALE_TARGET_CONCURRENCY


def default_ttft_slo_ms() -> int:
    return settings.AUTOSCALE_TTFT_SLO_MS


def default_itl_slo_ms() -> int:
    return settings.AUTOSCALE_ITL_SLO_MS


def default_idle_to_zero_seconds() -> int:
    return settings.AUTOSCALE_IDLE_TO_ZERO_SECONDS


# Each autoscaling field's bounds (fleet.services.deployments reports them per field); past them a
# typo, not a wish.
AUTOSCALING_BOUNDS = {
    "target_concurrency": (1, 1024),
    "ttft_slo_ms": (1, 600_000),
    "itl_slo_ms": (1, 60_000),
    "idle_to_zero_seconds": (0, 30 * 24 * 3600),
}


def _bounds(field: str) -> list:
    low, high = AUTOSCALING_BOUNDS[field]
    return [MinValueValidator(low), MaxValueValidator(high)]


class Deployment(models.Model):
    model = models.OneToOneField(Model, on_delete=models.PROTECT, related_name="deployment")
    desired_replicas = models.PositiveIntegerField(default=1)
    min_replicas = models.PositiveIntegerField(default=0)
    max_replicas = models.PositiveIntegerField(default=1)
    keep_warm = models.BooleanField(
        default=False,
        help_text="Never scale down for lack of traffic: idle replicas stay loaded.",
    )
    # The autoscaler (controlplane/fleet/autoscaling.py) moves desired_replicas within min..max.
    autoscale = models.BooleanField(
        default=True,
        help_text="Let the autoscaler set the desired replicas within min and max.",
    )
    target_concurrency = models.PositiveIntegerField(
        default=default_target_concurrency,
        validators=_bounds("target_concurrency"),
        help_text="Requests (running + waiting) one replica should carry at full utilisation.",
    )
    ttft_slo_ms = models.PositiveIntegerField(
        default=default_ttft_slo_ms,
        validators=_bounds("ttft_slo_ms"),
        help_text="Time to first token, p95, a replica should stay under (ms); the gateway sheds a request "
        "whose predicted wait is longer.",
    )
    itl_slo_ms = models.PositiveIntegerField(
        default=default_itl_slo_ms,
        validators=_bounds("itl_slo_ms"),
        help_text="Time between tokens, p95, a replica should stay under (ms).",
    )
    idle_to_zero_seconds = models.PositiveIntegerField(
        default=default_idle_to_zero_seconds,
        validators=_bounds("idle_to_zero_seconds"),
        help_text="Scale to zero (or min) after this long without requests; 0 never does.",
    )
    # An operator's quality bar for a quantized model: no replica is placed unless its perplexity is
    # measured and at most this fraction above its base model's (0.02: 2%). Null: no check.
    max_perplexity_increase = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0), MaxValueValidator(10.0)],
        help_text="Serve only if perplexity is measured and at most this fraction above the base model's "
        "(0.02 = 2%); empty: no check.",
    )
    # The last change of desired_replicas, by anyone: the autoscaler's cooldowns count from it.
    # Existing rows take the migration's time: their idle clock starts then, not at the epoch.
    scaled_at = models.DateTimeField(default=timezone.now, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model__public_name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(min_replicas__lte=F("max_replicas")),
                name="deployment_min_le_max",
                violation_error_message="Min replicas cannot exceed max replicas.",
            ),
            models.CheckConstraint(
                condition=Q(desired_replicas__gte=F("min_replicas")) & Q(desired_replicas__lte=F("max_replicas")),
                name="deployment_desired_within_bounds",
                violation_error_message="Desired replicas must lie between min and max replicas.",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.model.public_name} ×{self.desired_replicas}"
