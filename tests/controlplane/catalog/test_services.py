import pytest
from django.core.exceptions import ValidationError

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Model
from controlplane.catalog.services import (
    estimate_gpu_memory_bytes,
    model_create,
    model_gpu_need,
    model_set_enabled,
    model_update,
)
from tests.controlplane.factories import ModelFactory, PriceTierFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def _model_fields(**overrides):
    fields = dict(
        public_name="llama-3-8b-instruct",
        family="llama",
        kind=Model.Kind.CHAT,
        weights_path="/models/llama-3-8b-instruct",
        context_length=8192,
        parameter_count=8_030_000_000,
        price_tier=PriceTierFactory(),
    )
    return {**fields, **overrides}


def test_model_create_estimates_gpu_memory_when_not_given():
    model = model_create(**_model_fields())
    assert model.gpu_memory_bytes == estimate_gpu_memory_bytes(parameter_count=8_030_000_000)
    # bf16 weights alone are 2 bytes per parameter; the estimate must leave room beyond them.
    assert model.gpu_memory_bytes > 2 * 8_030_000_000


def test_quantized_models_are_estimated_by_their_weight_bytes():
    params = 8_030_000_000
    bf16, fp8, awq, gptq = (
        estimate_gpu_memory_bytes(parameter_count=params, quantization=q) for q in ("", "fp8", "awq-int4", "gptq-int4")
    )
    assert bf16 > fp8 > awq == gptq
    # FP8 halves the projections' bytes but not the bf16 embeddings'; INT4 quarters them.
    assert 0.5 * bf16 < fp8 < 0.65 * bf16
    assert 0.25 * bf16 < awq < 0.45 * bf16
    model = model_create(**_model_fields(quantization=Model.Quantization.FP8))
    assert (model.quantization, model.gpu_memory_bytes) == ("fp8", fp8)


def test_the_quantization_is_detected_from_the_workers_reports():
    path = "/models/llama-3-8b-awq"
    plain = WorkerFactory(model_roots=["/models"], model_paths=["/models/other"])
    reporting = WorkerFactory(model_roots=["/models"], model_paths=[path], model_quantization={path: "awq-int4"})
    model = model_create(**_model_fields(weights_path=path), verify_on=[reporting])
    assert model.quantization == "awq-int4"
    assert model.gpu_memory_bytes == estimate_gpu_memory_bytes(parameter_count=8_030_000_000, quantization="awq-int4")
    # A float checkpoint, one no worker reports, or no workers to ask: not quantized.
    float_model = model_create(**_model_fields(public_name="float", weights_path="/models/other"), verify_on=[plain])
    unchecked = model_create(**_model_fields(public_name="unchecked", weights_path=path))
    assert float_model.quantization == unchecked.quantization == ""


def test_an_unknown_quantization_is_refused():
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(quantization="int3"))
    assert "quantization" in error.value.message_dict


def test_model_create_keeps_a_given_memory_figure():
    model = model_create(**_model_fields(gpu_memory_bytes=20 * 1024**3))
    assert Model.objects.get(pk=model.pk).gpu_memory_bytes == 20 * 1024**3


def test_duplicate_public_name_raises_and_writes_nothing():
    model_create(**_model_fields())
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(family="other"))
    assert "public_name" in error.value.message_dict
    assert Model.objects.count() == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("public_name", "has space"),
        ("public_name", "-leading-dash"),
        ("public_name", ""),
        ("kind", "image"),
        ("context_length", 0),
        ("context_length", -1),
        ("parameter_count", 0),
        ("gpu_memory_bytes", 0),
        ("weights_path", ""),
        ("family", ""),
        ("max_model_len", 0),
        ("max_model_len", (1 << 22) + 1),
        ("max_images_per_request", 0),
        ("max_images_per_request", 257),
        ("max_image_bytes", 0),
        ("max_image_pixels", 0),
        ("low_detail_pixels", 0),
    ],
)
def test_invalid_model_fields_raise_naming_the_field(field, value):
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(**{field: value}))
    assert field in error.value.message_dict
    assert not Model.objects.exists()


def test_a_max_model_len_past_the_checkpoints_context_needs_allow_long_context():
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(context_length=8192, max_model_len=32768))
    assert error.value.message_dict["max_model_len"] == [
        "32768 tokens is past the checkpoint's context of 8192: allow long context to serve past it, or lower it."
    ]
    assert not Model.objects.exists()
    long = model_create(**_model_fields(context_length=8192, max_model_len=32768, allow_long_context=True))
    short = model_create(**_model_fields(public_name="llama-short", context_length=8192, max_model_len=4096))
    assert (long.served_context_length, short.served_context_length) == (32768, 4096)
    assert ModelFactory(context_length=8192).served_context_length == 8192


def test_model_update_checks_the_context_and_records_it():
    model = model_create(**_model_fields(context_length=8192))
    with pytest.raises(ValidationError, match="allow long context"):
        model_update(model=model, max_model_len=16384)
    model = model_update(model=model, max_model_len=16384, allow_long_context=True)
    model.refresh_from_db()
    assert (model.max_model_len, model.allow_long_context) == (16384, True)
    entry = AuditEntry.objects.filter(action=AuditEntry.Action.MODEL_UPDATE).get()
    assert entry.detail["max_model_len"] == [None, 16384]
    assert entry.detail["allow_long_context"] == [False, True]


def test_a_vision_models_image_limits_are_set_and_their_changes_recorded():
    model = model_create(**_model_fields(kind=Model.Kind.VISION, max_images_per_request=4, low_detail_pixels=256 * 256))
    model.refresh_from_db()
    assert (model.max_images_per_request, model.low_detail_pixels, model.max_image_bytes) == (4, 256 * 256, 20 << 20)
    assert AuditEntry.objects.get(action=AuditEntry.Action.MODEL_CREATE).detail["max_images_per_request"] == 4
    model_update(model=model, max_image_bytes=5 << 20, max_image_pixels=4096 * 4096)
    entry = AuditEntry.objects.filter(action=AuditEntry.Action.MODEL_UPDATE).get()
    assert entry.detail == {"max_image_bytes": [20 << 20, 5 << 20], "max_image_pixels": [8192 * 8192, 4096 * 4096]}


def test_model_set_enabled():
    model = ModelFactory()
    model_set_enabled(model=model, enabled=False)
    assert not Model.objects.get(pk=model.pk).enabled


@pytest.mark.parametrize("weights_path", ["/models/../etc", "/models/llama/../../elsewhere", "/models/.."])
def test_a_weights_path_with_dotdot_is_refused_even_unverified(weights_path):
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(weights_path=weights_path))
    assert error.value.message_dict["weights_path"] == [
        f"{weights_path} contains '..': give the checkpoint's own path, inside a worker's model root (--model-root)."
    ]
    assert not Model.objects.exists()


def test_a_weights_path_outside_a_workers_model_roots_is_refused_naming_them():
    inside = WorkerFactory(name="inside", model_roots=["/models"], model_paths=["/models/llama-3-8b-instruct"])
    outside = WorkerFactory(name="outside", model_roots=["/data/a", "/data/b"], model_paths=[])
    rootless = WorkerFactory(name="rootless", model_roots=[], model_paths=[])
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(), verify_on=[inside, outside, rootless])
    assert error.value.message_dict["weights_path"] == [
        "/models/llama-3-8b-instruct lies outside outside's model roots (/data/a, /data/b), so it refuses to load "
        "it: put the checkpoint under one of them, or start its daemon with another --model-root.",
        "rootless reports no model roots, so it loads no model: start its daemon with --model-root DIR naming "
        "the folder that holds /models/llama-3-8b-instruct.",
    ]
    assert not Model.objects.exists()
    assert model_create(**_model_fields(), verify_on=[inside]).weights_path == "/models/llama-3-8b-instruct"


def test_a_gguf_file_in_a_reported_checkpoint_folder_is_accepted():
    worker = WorkerFactory(name="host", model_roots=["/models"], model_paths=["/models/smollm2"])
    gguf = "/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_create(**_model_fields(weights_path=gguf), verify_on=[worker]).weights_path == gguf
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(public_name="other", weights_path="/models/elsewhere/m.gguf"), verify_on=[worker])
    assert "host has no checkpoint" in error.value.message_dict["weights_path"][0]


# --- how many GPUs a model needs ----------------------------------------------------------------

GB = 10**9  # vendors' gigabytes: an H200 is "141 GB"


def test_a_671b_model_needs_8_gpus_of_141_gb_in_fp8_and_16_in_bf16():
    model = model_create(
        **_model_fields(
            public_name="deepseek-v3", family="deepseek_v3", parameter_count=671_000_000_000, quantization="fp8"
        )
    )
    need = model_gpu_need(model=model, gpu_bytes=141 * GB)
    assert (need.as_sized, need.fp8, need.bf16) == (8, 8, 16)
    assert need.text == "needs 8 GPUs of 131.3 GiB in FP8, 16 in bf16"


def test_a_block_fp8_671b_model_is_split_over_8_gpus_and_an_int4_model_is_not_split():
    # Block-wise FP8 (DeepSeek-V3/R1's format) splits over tensor-parallel ranks; AWQ and GPTQ run on one GPU.
    fp8 = model_create(
        **_model_fields(public_name="deepseek-v3", parameter_count=671_000_000_000, quantization="fp8")
        | {"tensor_parallel_size": 8}
    )
    assert fp8.tensor_parallel_size == 8
    for quantization in ("awq-int4", "gptq-int4"):
        with pytest.raises(ValidationError) as error:
            model_create(**_model_fields(public_name=quantization, quantization=quantization, tensor_parallel_size=2))
        [message] = error.value.message_dict["tensor_parallel_size"]
        assert message.startswith(f"A {Model.Quantization(quantization).label} checkpoint runs on one GPU")
    assert not Model.objects.filter(quantization__in=["awq-int4", "gptq-int4"]).exists()


def test_a_measured_gpu_memory_figure_gets_its_own_count():
    model = ModelFactory(parameter_count=8_030_000_000, gpu_memory_bytes=300 * GB)
    need = model_gpu_need(model=model, gpu_bytes=141 * GB)
    assert need.text == "needs 1 GPU of 131.3 GiB in FP8, 1 in bf16 (4 for its gpu_memory_bytes, 279.4 GiB)"
    assert model_gpu_need(model=ModelFactory(parameter_count=10**14), gpu_bytes=141 * GB).text.startswith(
        "needs more than 16 GPUs of 131.3 GiB in FP8, more than 16 in bf16"
    )


def test_expert_parallel_is_one_of_the_engines_modes():
    model = model_create(**_model_fields(tensor_parallel_size=2, expert_parallel="all_to_all"))
    assert model.expert_parallel == Model.ExpertParallel.ALL_TO_ALL
    with pytest.raises(ValidationError) as error:
        model_create(**_model_fields(public_name="other", expert_parallel="alltoall"))
    assert "expert_parallel" in error.value.message_dict
