"""Forms of the operators' pages. They check shapes (numbers, choices); the rules (bounds, room on a
GPU, paths the workers report) live in the services, whose ValidationErrors
`dashboard.forms.apply_service_errors` puts beside the fields they name."""

from django import forms
from django.core.exceptions import ValidationError

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import IMAGE_LIMIT_FIELDS, Deployment, Model
from controlplane.catalog.selectors import deployments_with_model
from controlplane.catalog.services import estimate_gpu_memory_bytes, served_quantization
from controlplane.fleet.models import Gpu, Worker
from controlplane.fleet.selectors import (
    gpu_get_of_worker,
    worker_get,
    workers_for_path_check,
    workers_online_with_present_gpus,
)
from controlplane.fleet.services.deployments import MAX_REPLICAS_LIMIT


class ScaleForm(forms.Form):
    desired_replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS_LIMIT, label="Replicas")

    @classmethod
    def for_deployment(cls, deployment: Deployment) -> "ScaleForm":
        """Filled with the deployment's desired replicas."""
        return cls(initial={"desired_replicas": deployment.desired_replicas}, prefix=f"s{deployment.pk}")


class DeploymentLimitsForm(forms.Form):
    desired_replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS_LIMIT, label="Desired")
    min_replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS_LIMIT, label="Min")
    max_replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS_LIMIT, label="Max")
    keep_warm = forms.BooleanField(
        required=False, label="Keep warm", help_text="Idle replicas stay loaded instead of being scaled down."
    )
    # Autoscaling: bounds are the service's (catalog.models.AUTOSCALING_BOUNDS), reported per field;
    # a number left empty keeps its value.
    autoscale = forms.BooleanField(
        required=False, label="Autoscale", help_text="Let the autoscaler set the desired replicas within min and max."
    )
    target_concurrency = forms.IntegerField(
        required=False,
        label="Requests per replica",
        help_text="Running + waiting requests one replica carries at full load.",
    )
    ttft_slo_ms = forms.IntegerField(
        required=False,
        label="TTFT objective (ms)",
        help_text="Time to first token, p95: the autoscaler's target, and the gateway sheds (429) a request "
        "predicted to wait longer.",
    )
    itl_slo_ms = forms.IntegerField(required=False, label="Inter-token SLO (ms)", help_text="Time between tokens, p95.")
    idle_to_zero_seconds = forms.IntegerField(
        required=False, label="Idle to zero (s)", help_text="No request for this long: scale to min (0 never does)."
    )
    # The quality bar: empty clears it (no check).
    max_perplexity_increase = forms.FloatField(
        required=False,
        label="Max perplexity increase",
        help_text="Serve only if the model's perplexity is measured and at most this fraction above its base "
        "model's (0.02 = 2%); empty: no check.",
    )

    @classmethod
    def for_deployment(cls, deployment: Deployment, *, reach: int | None = None, **kwargs) -> "DeploymentLimitsForm":
        """The deployment's settings; with `reach`, filled in to scale to that many replicas (Min or
        Max moved just enough), so a refused scale is one Save away."""
        initial = {name: getattr(deployment, name) for name in cls.base_fields}
        if reach is not None:
            initial.update(
                desired_replicas=reach,
                min_replicas=min(deployment.min_replicas, reach),
                max_replicas=max(deployment.max_replicas, reach),
            )
        return cls(initial=initial, prefix=f"d{deployment.pk}", **kwargs)


def slot_value(worker_id: int, gpu_id: int | None) -> str:
    return f"{worker_id}:{gpu_id if gpu_id is not None else 'cpu'}"


class LoadForm(forms.Form):
    """Load one more replica of a deployment on a chosen worker's GPU (or a CPU worker's memory)."""

    deployment = forms.ModelChoiceField(queryset=deployments_with_model(), empty_label="Choose a model…", label="Model")
    slot = forms.ChoiceField(label="Worker / GPU", help_text="For a model split over several GPUs: the first of them.")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["deployment"].label_from_instance = lambda d: d.model.public_name
        choices = [("", "Choose where…")]
        for worker in workers_online_with_present_gpus():
            for gpu in worker.present_gpus:
                choices.append((slot_value(worker.pk, gpu.pk), f"{worker.name} · GPU {gpu.index} ({gpu.name})"))
            if worker.device == Worker.Device.CPU:
                choices.append((slot_value(worker.pk, None), f"{worker.name} · CPU"))
        self.fields["slot"].choices = choices

    def clean_slot(self) -> tuple[Worker, Gpu | None]:
        worker_id, _, gpu_part = self.cleaned_data["slot"].partition(":")
        worker = worker_get(pk=int(worker_id))
        gpu = None if gpu_part == "cpu" else gpu_get_of_worker(pk=int(gpu_part), worker=worker)
        if worker is None or (gpu_part != "cpu" and gpu is None):
            raise ValidationError("That worker or GPU is gone; choose again.")
        return worker, gpu


class CatalogModelForm(forms.ModelForm):
    """Add or edit a catalog model; the weight path is checked against the chosen workers' reports,
    which also say how the checkpoint is quantized."""

    DETECT = "detect"
    IMAGE_LIMIT_FIELDS = IMAGE_LIMIT_FIELDS

    context_length = forms.IntegerField(
        min_value=1,
        label="Context length (tokens)",
        help_text="The checkpoint's own context (its max_position_embeddings).",
    )
    parameter_count = forms.IntegerField(min_value=1, label="Parameters")
    gpu_memory_bytes = forms.IntegerField(
        min_value=1,
        required=False,
        label="GPU memory (bytes)",
        help_text="Weights plus a working KV cache. Leave empty to estimate from the parameter count "
        "and the quantization.",
    )
    quantization = forms.ChoiceField(
        choices=[(DETECT, "Detect from the checkpoint"), *Model.Quantization.choices],
        initial=DETECT,
        required=False,
        label="Quantization",
        help_text="As the checked workers report the checkpoint's config.json; a float checkpoint if none does.",
    )
    expert_parallel = forms.ChoiceField(
        choices=Model.ExpertParallel.choices,
        initial=Model.ExpertParallel.ALL_REDUCE,
        required=False,
        label="Experts across GPUs",
        help_text="For a mixture-of-experts model split over several GPUs: all-reduce runs every token on "
        "every GPU's experts; all-to-all sends each token only to the GPUs of its chosen experts. The "
        "experts must divide by the GPUs per replica.",
    )
    check_workers = forms.ModelMultipleChoiceField(
        queryset=workers_for_path_check(),
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Check the weight path on",
        help_text="Workers that report their model roots confirm the path exists; others cannot tell.",
    )

    class Meta:
        model = Model
        fields = [
            "public_name",
            "family",
            "kind",
            "weights_path",
            "context_length",
            "max_model_len",
            "allow_long_context",
            "parameter_count",
            "quantization",
            "load_quantization",
            "gpu_memory_bytes",
            "tensor_parallel_size",
            "expert_parallel",
            "price_tier",
            "base_model",
            "enabled",
            *IMAGE_LIMIT_FIELDS,
        ]
        labels = {
            "public_name": "Name",
            "weights_path": "Weight path",
            "price_tier": "Price tier",
            "tensor_parallel_size": "GPUs per replica",
            "base_model": "Base model",
            "load_quantization": "Quantization at load",
            "max_model_len": "Max model length (tokens)",
            "allow_long_context": "Allow long context",
            "max_images_per_request": "Images per request",
            "max_image_bytes": "Largest image (bytes)",
            "max_image_pixels": "Most pixels an image",
            "low_detail_pixels": "Low-detail pixels",
        }
        help_texts = {
            "public_name": "What clients send as `model`.",
            "tensor_parallel_size": "Tensor parallel: a replica is split over this many GPUs of one worker, "
            "each holding its share of the GPU memory. The model's attention "
            "heads must divide by it.",
            "weights_path": "A directory in Hugging Face layout on the worker hosts, inside their model roots "
            "(--model-root), e.g. /models/llama-3-8b.",
        }

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        workers = workers_for_path_check()
        self.fields["check_workers"].queryset = workers
        self.fields["check_workers"].label_from_instance = lambda w: f"{w.name} ({w.get_state_display().lower()})"
        if not self.is_bound:
            self.initial.setdefault("check_workers", [w.pk for w in workers if w.state == Worker.State.ONLINE])
        for name in IMAGE_LIMIT_FIELDS:  # left empty: the model keeps its limit (clean)
            self.fields[name].required = False

    def image_limit_fields(self) -> list:
        """The image limits' bound fields, shown apart from the others: only vision models use them."""
        return [self[name] for name in IMAGE_LIMIT_FIELDS]

    def clean_weights_path(self) -> str:
        path = self.cleaned_data["weights_path"].strip()
        if not path.startswith("/"):
            raise ValidationError("Give an absolute path, e.g. /models/llama-3-8b.")
        return path

    def clean(self) -> dict:
        cleaned = super().clean()
        given, load_quantization = cleaned.get("quantization"), cleaned.get("load_quantization") or ""
        try:
            cleaned["quantization"] = served_quantization(
                weights_path=cleaned.get("weights_path") or "",
                quantization=None if given in (self.DETECT, None) else given,
                load_quantization=load_quantization,
                workers=cleaned.get("check_workers"),
            )
        except ValidationError as exc:  # only FP8 at load of a quantized checkpoint
            self.add_error(None, exc)
            cleaned["quantization"] = load_quantization
        if not cleaned.get("expert_parallel"):
            cleaned["expert_parallel"] = Model.ExpertParallel.ALL_REDUCE
        for name in IMAGE_LIMIT_FIELDS:
            if cleaned.get(name) is None and name not in self.errors:
                cleaned[name] = getattr(self.instance, name)  # a new model's: the default
        if cleaned.get("gpu_memory_bytes") is None and cleaned.get("parameter_count"):
            # The ModelForm builds and validates its instance from cleaned_data after this.
            cleaned["gpu_memory_bytes"] = estimate_gpu_memory_bytes(
                parameter_count=cleaned["parameter_count"], quantization=cleaned.get("quantization") or ""
            )
        return cleaned

    def model_fields(self) -> dict:
        return {name: self.cleaned_data[name] for name in self.Meta.fields}


class CheckpointForm(forms.Form):
    """Name a checkpoint for the add-model form to be filled from (catalog.checkpoints)."""

    checkpoint = forms.CharField(
        max_length=500,
        label="Checkpoint",
        help_text="A path under a worker's model roots (/models/llama-3-8b) or a Hugging Face id "
        "(meta-llama/Llama-3.2-1B) found there as org/name or in a Hugging Face cache.",
    )


class AuditFilterForm(forms.Form):
    action = forms.ChoiceField(required=False, label="Action")
    actor = forms.ChoiceField(required=False, label="Who")

    def __init__(self, *args, actors: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["action"].choices = [("", "Every action"), *AuditEntry.Action.choices]
        self.fields["actor"].choices = [("", "Everyone"), *((a, a) for a in actors)]
