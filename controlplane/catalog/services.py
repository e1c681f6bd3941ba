"""Writes for the catalog: adding, editing, enabling and disabling models. Atomic and fully
validated; every change lands in the audit log (`actor`: the user acting, None for the system).
Deployments (how many replicas of a model) are the fleet's: `controlplane.fleet.services.deployments`.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath

from django.core.exceptions import ValidationError
from django.db import transaction
from django.forms.models import model_to_dict
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record, changes
from controlplane.catalog.models import IMAGE_LIMIT_FIELDS, Model
from controlplane.catalog.selectors import reported_quantization, weights_path_reports
from controlplane.common.units import human_bytes
from gpuworker.contract.placement import MAX_TENSOR_PARALLEL_SIZE, gpus_needed
from gpuworker.contract.quality import PerplexityReport

# What a model edit may change, and what its audit entry compares.
MODEL_FIELDS = (
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
)

# Bytes per parameter of the weights by quantization, and the share added for activations and a KV
# cache large enough to batch; an operator can always enter a measured figure instead. Quantized
# checkpoints keep embeddings and lm_head in bf16 (13% of Llama-3-8B's parameters): 15% of the
# parameters are counted at 2 bytes. INT4 holds a float16 scale and a uint8 zero point per 128 weights.
_BYTES_PER_PARAMETER = {
    Model.Quantization.NONE: 2.0,
    Model.Quantization.FP8: 1.0,
    Model.Quantization.AWQ_INT4: 0.5 + 3 / 128,
    Model.Quantization.GPTQ_INT4: 0.5 + 3 / 128,
}
_DENSE_SHARE = 0.15
_RUNTIME_OVERHEAD = 1.2


def estimate_gpu_memory_bytes(*, parameter_count: int, quantization: str = Model.Quantization.NONE) -> int:
    per_parameter = dense = _BYTES_PER_PARAMETER[Model.Quantization.NONE]
    if quantization != Model.Quantization.NONE:
        per_parameter = (1 - _DENSE_SHARE) * _BYTES_PER_PARAMETER[quantization] + _DENSE_SHARE * dense
    return int(parameter_count * per_parameter * _RUNTIME_OVERHEAD)


@dataclass(frozen=True)
class GpuNeed:
    """How many GPUs of gpu_bytes a model needs: as its gpu_memory_bytes says (its checkpoint's
    format, or an operator's measured figure), and, from its parameter count, with its weights in
    FP8 and in bf16 (estimate_gpu_memory_bytes: weights plus KV headroom). None: more than
    MAX_TENSOR_PARALLEL_SIZE."""

    gpu_bytes: int
    need_bytes: int
    as_sized: int | None
    fp8: int | None
    bf16: int | None

    @property
    def text(self) -> str:
        """e.g. "needs 8 GPUs of 131.3 GiB in FP8, 16 in bf16"; the count for gpu_memory_bytes is
        added where it differs from the FP8 and bf16 estimates."""
        fp8, bf16, sized = (_count(n) for n in (self.fp8, self.bf16, self.as_sized))
        text = f"needs {fp8} GPU{'s' * (self.fp8 != 1)} of {human_bytes(self.gpu_bytes)} in FP8, {bf16} in bf16"
        if self.as_sized not in (self.fp8, self.bf16):
            text += f" ({sized} for its gpu_memory_bytes, {human_bytes(self.need_bytes)})"
        return text


def _count(gpus: int | None) -> str:
    return str(gpus) if gpus is not None else f"more than {MAX_TENSOR_PARALLEL_SIZE}"


def model_gpu_need(*, model: Model, gpu_bytes: int) -> GpuNeed:
    """How many GPUs of `gpu_bytes` each `model` needs (GpuNeed), for placement's refusals."""

    def count(quantization: str) -> int | None:
        need = estimate_gpu_memory_bytes(parameter_count=model.parameter_count, quantization=quantization)
        return gpus_needed(need_bytes=need, gpu_bytes=gpu_bytes)

    return GpuNeed(
        gpu_bytes=gpu_bytes,
        need_bytes=model.gpu_memory_bytes,
        as_sized=gpus_needed(need_bytes=model.gpu_memory_bytes, gpu_bytes=gpu_bytes),
        fp8=count(Model.Quantization.FP8),
        bf16=count(Model.Quantization.NONE),
    )


def _check_weights_path(weights_path: str, verify_on: Iterable | None) -> None:
    """Refuse a path with `..` in it (the stored path is the one workers are sent, and must say
    where the checkpoint is), and one that a chosen worker cannot load: outside its model roots,
    no roots at all, or no checkpoint there."""
    if ".." in PurePosixPath(weights_path).parts:
        raise ValidationError(
            {
                "weights_path": f"{weights_path} contains '..': give the checkpoint's own path, "
                f"inside a worker's model root (--model-root)."
            }
        )
    if verify_on is None or not weights_path:
        return
    refused = [r.message for r in weights_path_reports(weights_path=weights_path, workers=verify_on) if not r.loadable]
    if refused:
        raise ValidationError({"weights_path": refused})


def served_quantization(
    *, weights_path: str, quantization: str | None, load_quantization: str, workers: Iterable | None
) -> str:
    """What a model serves: `quantization` as given (None: as `workers` report the checkpoint, a
    float one if none does), or with FP8 at load, FP8. A ValidationError refuses FP8 at load of a
    checkpoint a worker reports already quantized."""
    reported = reported_quantization(weights_path=weights_path, workers=workers or ())
    if load_quantization:
        if reported:
            raise ValidationError(
                {
                    "load_quantization": f"The checkpoint at {weights_path} is already quantized ({reported}): "
                    f"only a float checkpoint can be quantized at load. Leave the quantization at load empty."
                }
            )
        return load_quantization if quantization is None else quantization
    return (reported or Model.Quantization.NONE) if quantization is None else quantization


def model_snapshot(model: Model) -> dict:
    values = model_to_dict(model, fields=MODEL_FIELDS)
    values["price_tier"] = str(model.price_tier) if model.price_tier_id else None
    values["base_model"] = str(model.base_model) if model.base_model_id else None
    return values


@transaction.atomic
def model_create(
    *,
    public_name: str,
    family: str,
    kind: str,
    weights_path: str,
    context_length: int,
    parameter_count: int,
    price_tier,
    gpu_memory_bytes: int | None = None,
    quantization: str | None = None,
    load_quantization: str = Model.LoadQuantization.NONE,
    max_model_len: int | None = None,
    allow_long_context: bool = False,
    tensor_parallel_size: int = 1,
    expert_parallel: str = Model.ExpertParallel.ALL_REDUCE,
    base_model: Model | None = None,
    enabled: bool = True,
    max_images_per_request: int | None = None,
    max_image_bytes: int | None = None,
    max_image_pixels: int | None = None,
    low_detail_pixels: int | None = None,
    actor=None,
    verify_on: Iterable | None = None,
) -> Model:
    """Add a model. `verify_on`: workers whose reported checkpoints the weight path must be among
    (inside their model roots, a checkpoint there); None checks only the path itself.
    `quantization` None: as those workers report the checkpoint (a float one if none does), or FP8
    with `load_quantization` "fp8" (served_quantization). An image limit left None takes the
    model's default."""
    quantization = served_quantization(
        weights_path=weights_path, quantization=quantization, load_quantization=load_quantization, workers=verify_on
    )
    if (
        gpu_memory_bytes is None
        and isinstance(parameter_count, int)
        and parameter_count > 0
        and quantization in Model.Quantization.values
    ):
        gpu_memory_bytes = estimate_gpu_memory_bytes(parameter_count=parameter_count, quantization=quantization)
    image_limits = {
        "max_images_per_request": max_images_per_request,
        "max_image_bytes": max_image_bytes,
        "max_image_pixels": max_image_pixels,
        "low_detail_pixels": low_detail_pixels,
    }
    model = Model(
        public_name=public_name,
        family=family,
        kind=kind,
        weights_path=weights_path,
        context_length=context_length,
        max_model_len=max_model_len,
        allow_long_context=allow_long_context,
        parameter_count=parameter_count,
        quantization=quantization,
        load_quantization=load_quantization,
        gpu_memory_bytes=gpu_memory_bytes,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel=expert_parallel,
        price_tier=price_tier,
        base_model=base_model,
        enabled=enabled,
        **{name: value for name, value in image_limits.items() if value is not None},
    )
    model.full_clean()
    _check_weights_path(model.weights_path, verify_on)
    model.save()
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_CREATE, target=model, detail=model_snapshot(model))
    return model


@transaction.atomic
def model_update(*, model: Model, actor=None, verify_on: Iterable | None = None, **fields) -> Model:
    """Change any of MODEL_FIELDS. A new weight path is checked like model_create's; changing
    the weights (or the model's memory) makes reconcile retry workers where it failed before."""
    unknown = set(fields) - set(MODEL_FIELDS)
    if unknown:
        raise TypeError(f"model_update cannot change {', '.join(sorted(unknown))}")
    model = Model.objects.select_for_update().select_related("price_tier").get(pk=model.pk)
    before = model_snapshot(model)
    for name, value in fields.items():
        setattr(model, name, value)
    model.full_clean()
    if model.weights_path != before["weights_path"]:
        _check_weights_path(model.weights_path, verify_on)
    after = model_snapshot(model)
    diff = changes(before, after)
    if not diff:
        return model
    model.save()
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_UPDATE, target=model, detail=diff)
    return model


@transaction.atomic
def model_set_enabled(*, model: Model, enabled: bool, actor=None) -> Model:
    model = Model.objects.select_for_update().get(pk=model.pk)
    if model.enabled == enabled:
        return model  # nothing changed, nothing to record
    model.enabled = enabled
    model.save(update_fields=["enabled", "updated_at"])
    action = AuditEntry.Action.MODEL_ENABLE if enabled else AuditEntry.Action.MODEL_DISABLE
    audit_record(actor=actor, action=action, target=model, detail={"enabled": [not enabled, enabled]})
    return model


@transaction.atomic
def model_record_perplexity(*, model: Model, report: PerplexityReport, actor=None) -> Model:
    """Store the worker's perplexity report (python -m gpuworker.quality) on the model. The report
    must be of the weights the catalog serves: a model stored as FP8 measured as FP8, a float one as
    float (a ValidationError names the mismatch; nothing is stored)."""
    model = Model.objects.select_for_update().get(pk=model.pk)
    if report.quantization != model.quantization:
        measured = report.quantization or "unquantized"
        stored = model.quantization or "unquantized"
        raise ValidationError(
            {"quantization": f"The report measured {measured} weights but {model.public_name} serves {stored} weights."}
        )
    before = model.perplexity
    model.perplexity = report.perplexity
    model.perplexity_tokens = report.tokens
    model.perplexity_window = report.window
    model.perplexity_text_sha256 = report.text_sha256
    model.perplexity_measured_at = timezone.now()
    model.save()
    detail = {"perplexity": [before, report.perplexity], "tokens": report.tokens, "window": report.window}
    audit_record(actor=actor, action=AuditEntry.Action.MODEL_UPDATE, target=model, detail=detail)
    return model
