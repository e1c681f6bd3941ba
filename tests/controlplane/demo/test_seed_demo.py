"""`manage.py seed_demo`: creates the demo once, reuses it (and its secrets) on every later run."""

import json
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.management import call_command

from controlplane.accounts.models import ApiKey, Tenant, User
from controlplane.accounts.selectors import api_key_authenticate
from controlplane.billing.models import CreditEntry, Plan, PriceTier
from controlplane.billing.selectors import credit_balance
from controlplane.catalog.models import Deployment, Model
from controlplane.demo.seed import ensure_embedding_model
from controlplane.env import read_env_file
from gpuworker.daemon.model_paths import scan_model_roots

pytestmark = pytest.mark.django_db

SEEDED = [Tenant, User, ApiKey, PriceTier, Plan, CreditEntry, Model, Deployment]


def _counts():
    return {model.__name__: model.objects.count() for model in SEEDED}


def _seed(env_file):
    call_command("seed_demo", env_file=env_file, stdout=open("/dev/null", "w"))
    return read_env_file(env_file)


def test_seed_creates_a_working_demo(tmp_path):
    env_file = tmp_path / ".env.demo"
    demo = _seed(env_file)

    assert demo["OPENAI_BASE_URL"] == "http://127.0.0.1:8000/v1"
    api_key = api_key_authenticate(plaintext=demo["OPENAI_API_KEY"])
    assert api_key.tenant.name == "Demo tenant" and api_key.tenant.plan is not None
    assert credit_balance(tenant=api_key.tenant) == Decimal("10.00")
    admin = User.objects.get(username=demo["DEMO_ADMIN_USERNAME"])
    assert admin.check_password(demo["DEMO_ADMIN_PASSWORD"])
    assert admin.role == User.Role.ADMIN and admin.is_staff and admin.is_superuser
    # One login per role, each with its own password in the env file.
    operator = User.objects.get(username="operator")
    assert operator.role == User.Role.OPERATOR and operator.check_password(demo["DEMO_OPERATOR_PASSWORD"])
    assert not operator.is_staff and operator.tenant is None
    member = User.objects.get(username="member")
    assert member.role == User.Role.TENANT_MEMBER and member.check_password(demo["DEMO_MEMBER_PASSWORD"])
    assert member.tenant == api_key.tenant
    assert member.tenant_role == User.TenantRole.ADMIN  # someone on the demo tenant can manage its team
    # Requests cost money from the first one (the plan includes none), so cost figures show.
    assert api_key.tenant.plan.included_requests_per_month == 0
    model = Model.objects.get(public_name="demo-tiny")
    assert model.price_tier.price_per_request > 0
    assert model.deployment.desired_replicas == 1 and model.enabled
    # Every demo deployment may be scaled to a second replica.
    assert {d.max_replicas for d in Deployment.objects.all()} == {2}
    # The demo weights are written once, where the model row says; the daemon loads them from there.
    assert (Path(model.weights_path) / "config.json").is_file()
    # The real chat model: SmolLM2's GGUF file, copied where its row says (inside the model roots).
    chat = Model.objects.get(public_name="smollm2-135m-instruct")
    assert chat.deployment.desired_replicas == 1 and chat.kind == Model.Kind.CHAT
    [weights] = Path(chat.weights_path).iterdir()
    assert weights.suffix == ".gguf" and not weights.is_symlink() and weights.stat().st_size > 50_000_000
    # Its FP8-at-load twin: the same file, FP8 in the catalog (and its estimate), compared with it, not deployed.
    fp8 = Model.objects.get(public_name="smollm2-135m-instruct-fp8")
    assert (fp8.weights_path, fp8.base_model, fp8.quantization, fp8.load_quantization) == (
        chat.weights_path,
        chat,
        "fp8",
        "fp8",
    )
    assert fp8.gpu_memory_bytes < chat.gpu_memory_bytes and not Deployment.objects.filter(model=fp8).exists()
    # The embedding model: all-MiniLM-L6-v2 unzipped where its row says, a folder the daemon's scan reports.
    embedding = Model.objects.get(public_name="all-minilm-l6-v2")
    assert embedding.deployment.desired_replicas == 1 and embedding.kind == Model.Kind.EMBEDDING
    assert embedding.family == "bert" and embedding.context_length == 512
    embedding_path = Path(embedding.weights_path)
    assert (embedding_path / "model.safetensors").stat().st_size > 80_000_000
    assert (embedding_path / "1_Pooling" / "config.json").is_file()
    assert str(embedding_path) in scan_model_roots([embedding_path.parent]).paths
    # The vision model: a tiny random Qwen2.5-VL written where its row says, with its image processor.
    vision = Model.objects.get(public_name="demo-vision")
    assert vision.kind == Model.Kind.VISION and vision.deployment.desired_replicas == 1
    vision_path = Path(vision.weights_path)
    config = json.loads((vision_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert (vision_path / "preprocessor_config.json").is_file()
    assert str(vision_path) in scan_model_roots([vision_path.parent]).paths
    assert env_file.stat().st_mode & 0o077 == 0, "the file holds secrets and must be private"


def test_seed_twice_reuses_everything(tmp_path):
    env_file = tmp_path / ".env.demo"
    first = _seed(env_file)
    counts = _counts()
    second = _seed(env_file)
    assert second == first
    assert _counts() == counts


def test_seed_without_the_env_file_issues_a_new_key_and_password(tmp_path):
    first = _seed(tmp_path / "a.env")
    second = _seed(tmp_path / "b.env")
    assert second["OPENAI_API_KEY"] != first["OPENAI_API_KEY"]
    api_key_authenticate(plaintext=second["OPENAI_API_KEY"])
    for username in ("admin", "operator", "member"):
        assert User.objects.get(username=username).check_password(second[f"DEMO_{username.upper()}_PASSWORD"])
    # The demo tenant and the one the operators' playground bills, each with its credit.
    assert Tenant.objects.count() == 2 and Model.objects.count() == 5 and CreditEntry.objects.count() == 2


def test_seed_replaces_a_key_that_no_longer_works(tmp_path):
    env_file = tmp_path / ".env.demo"
    first = _seed(env_file)
    ApiKey.objects.update(revoked=True)
    second = _seed(env_file)
    assert second["OPENAI_API_KEY"] != first["OPENAI_API_KEY"]
    assert api_key_authenticate(plaintext=second["OPENAI_API_KEY"]).name == "demo 2"
    assert second["DEMO_ADMIN_PASSWORD"] == first["DEMO_ADMIN_PASSWORD"]


def test_seed_replaces_only_the_password_that_no_longer_works(tmp_path):
    env_file = tmp_path / ".env.demo"
    first = _seed(env_file)
    User.objects.filter(username="operator").update(password="!")
    second = _seed(env_file)
    assert second["DEMO_OPERATOR_PASSWORD"] != first["DEMO_OPERATOR_PASSWORD"]
    assert User.objects.get(username="operator").check_password(second["DEMO_OPERATOR_PASSWORD"])
    assert {k: v for k, v in second.items() if k != "DEMO_OPERATOR_PASSWORD"} == {
        k: v for k, v in first.items() if k != "DEMO_OPERATOR_PASSWORD"
    }


def test_embedding_model_unzip_replaces_an_interrupted_one(tmp_path):
    target = tmp_path / "all-minilm-l6-v2"
    # A killed earlier unzip leaves only the partial folder, never a half-filled checkpoint.
    (tmp_path / "all-minilm-l6-v2.partial").mkdir()
    (tmp_path / "all-minilm-l6-v2.partial" / "config.json").write_text("{")
    (tmp_path / "all-minilm-l6-v2.partial" / "stale.safetensors").write_text("")
    assert ensure_embedding_model(target) is True
    assert sorted(path.name for path in tmp_path.iterdir()) == ["all-minilm-l6-v2"]
    assert json.loads((target / "config.json").read_text())["model_type"] == "bert"
    assert not (target / "stale.safetensors").exists()
    assert ensure_embedding_model(target) is False
