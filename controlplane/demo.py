"""The demo that `make run` seeds: an admin login, a tenant with credits and a key, and the tiny
random-weight demo model (written to VAR_DIR/models/demo-tiny) deployed with one replica, which
reconcile places on the local GPU worker daemon like any other model.

Idempotent: objects are looked up by name and created only when missing. Secrets cannot be read
back from the database (only hashes are kept), so they live in `.env.demo`: a key or password
found there is reused while it still works, and replaced otherwise.
"""

import os
import secrets
import subprocess
import sys
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
from controlplane.env import read_env_file
from controlplane.fleet.selectors import deployment_get_for_model
from controlplane.fleet.services import deployment_create

BASE_URL = "http://127.0.0.1:8000"
ADMIN_USERNAME = "admin"
TENANT_NAME = "Demo tenant"
PRICE_TIER_NAME = "standard"
PLAN_NAME = "Demo"
MODEL_NAME = "demo-tiny"
DEMO_CONTEXT_LENGTH = 2048
GRANT = Decimal("10.00")
KEY_NAME = "demo"


@dataclass(frozen=True)
class DemoSeed:
    base_url: str
    admin_username: str
    admin_password: str
    api_key: str
    created: list[str] = field(default_factory=list)


def write_env_file(path: Path, seed: DemoSeed) -> None:
    text = (
        "# Written by `manage.py seed_demo` for the local demo; it holds secrets, keep it private.\n"
        f"OPENAI_BASE_URL={seed.base_url}/v1\n"
        f"OPENAI_API_KEY={seed.api_key}\n"
        f"DEMO_ADMIN_USERNAME={seed.admin_username}\n"
        f"DEMO_ADMIN_PASSWORD={seed.admin_password}\n"
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
    subprocess.run([sys.executable, "-m", "gpuworker.demo_model", str(path),
                    "--max-position-embeddings", str(DEMO_CONTEXT_LENGTH)], check=True, stdout=subprocess.DEVNULL)
    return True


def seed_demo(*, env_path: Path) -> DemoSeed:
    saved = read_env_file(env_path)
    wrote_model = ensure_demo_model(demo_model_path())
    seed = _seed_database(saved)
    if wrote_model:
        seed.created.insert(0, f"demo weights in {demo_model_path()}")
    write_env_file(env_path, seed)
    return seed


@transaction.atomic
def _seed_database(saved: dict[str, str]) -> DemoSeed:
    created: list[str] = []
    tier = price_tier_get_by_name(name=PRICE_TIER_NAME)
    if tier is None:
        tier = price_tier_create(
            name=PRICE_TIER_NAME,
            price_per_request=Decimal("0.002"),
            reference_price_per_million_tokens=Decimal("0.50"),
        )
        created.append(f"price tier {tier.name}")
    plan = plan_get_by_name(name=PLAN_NAME)
    if plan is None:
        plan = plan_create(name=PLAN_NAME, included_requests_per_month=1000, rate_limit_per_minute=60)
        created.append(f"plan {plan.name}")
    tenant = tenant_get_by_name(name=TENANT_NAME)
    if tenant is None:
        tenant = tenant_create(name=TENANT_NAME, plan=plan)
        created.append(f"tenant {tenant.name}")
    if not credit_entries_for_tenant(tenant=tenant).exists():
        credit_grant(tenant=tenant, amount=GRANT, memo="Demo credits")
        created.append(f"{GRANT} credits")
    model = _seed_model(tier, created)
    password = _seed_admin(saved.get("DEMO_ADMIN_PASSWORD", ""), created)
    api_key = _seed_api_key(tenant, saved.get("OPENAI_API_KEY", ""), created)
    return DemoSeed(
        base_url=BASE_URL, admin_username=ADMIN_USERNAME, admin_password=password,
        api_key=api_key, created=created,
    )


def _seed_model(tier, created: list[str]) -> Model:
    model = model_get_by_public_name(public_name=MODEL_NAME)
    if model is None:
        model = model_create(
            public_name=MODEL_NAME,
            family="llama",
            kind=Model.Kind.CHAT,
            weights_path=str(demo_model_path()),
            context_length=DEMO_CONTEXT_LENGTH,
            parameter_count=4_000_000,
            price_tier=tier,
        )
        created.append(f"model {model.public_name}")
    if deployment_get_for_model(model=model) is None:
        deployment_create(
            model_name=model.public_name, desired_replicas=1, min_replicas=0, max_replicas=1, keep_warm=True
        )
        created.append(f"deployment of {model.public_name}")
    return model


def _seed_admin(saved_password: str, created: list[str]) -> str:
    user = user_get_by_username(username=ADMIN_USERNAME)
    if user is not None and saved_password and user.check_password(saved_password):
        return saved_password
    password = secrets.token_urlsafe(12)
    if user is None:
        user_create(username=ADMIN_USERNAME, password=password, role=User.Role.ADMIN)
        created.append(f"admin login {ADMIN_USERNAME}")
    else:
        user_set_password(user=user, password=password)
        created.append(f"new password for {ADMIN_USERNAME}")
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
