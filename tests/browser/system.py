"""The whole system, once, for the browser tests and the screenshot script: the integration tests'
`Fleet` (uvicorn serving controlplane.asgi, a Celery worker with beat, and a real gpuworker daemon on
CPU) over a database seeded like `make run` seeds it, plus one login per role and a second tenant.

Starting it costs about half a minute on two cores, so callers start it once (per test package, or
per screenshot run) and share it. Nothing here imports pytest fixtures: the browser tests hand
`start_system` a scratch folder and the Redis URL, and the scripts (tests/browser/screenshots.py,
bench/playground.py) take the whole system, database included, from `scratch_system`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import django
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings, setup_databases, teardown_databases

from tests.integration.conftest import Fleet

CHROMIUM = "/usr/bin/chromium"
# Browser tests share one daemon with a loaded two-core machine and a headless browser: heartbeats
# may lag by seconds there, which must not look like a lost worker.
# The tests scale the demo deployment by hand and watch its replicas: the autoscaler's first tick
# comes after the session (an hour), so it never moves them meanwhile.
SYSTEM_ENV = {"FLEET_WORKER_LOST_AFTER_SECONDS": "20", "OMP_NUM_THREADS": "1", "AUTOSCALE_INTERVAL_SECONDS": "3600"}
# Passes Django's password validators; the same for every login, none of them is a secret.
PASSWORD = "browser-tests-Pa55word"
OTHER_TENANT_NAME = "Other tenant"
PAY_AS_YOU_GO_PLAN = "Pay as you go"  # no included requests: every request is charged


@dataclass(frozen=True)
class Login:
    username: str
    password: str
    role: str


@dataclass(frozen=True)
class Seeded:
    """What the seed created that tests refer to: logins by role and the objects they open."""

    logins: dict[str, Login]
    demo_model: str
    tenant_name: str
    other_tenant_name: str
    other_tenant_key_id: int
    api_key: str  # the demo tenant's key, for traffic through /v1


class System:
    """A started system: `url`, the `fleet` (its processes and logs) and what was `seeded`."""

    def __init__(self, fleet: Fleet, seeded: Seeded) -> None:
        self.fleet = fleet
        self.seeded = seeded
        self.url = fleet.url

    @property
    def models_dir(self) -> Path:
        """The folder of checkpoints the daemon reports (the demo model is in it)."""
        return self.fleet.tmp_path / "var" / "models"

    def login(self, role: str) -> Login:
        return self.seeded.logins[role]

    def stop(self) -> None:
        self.fleet.stop()


def launch_options() -> dict:
    """How every browser test starts Chromium: Debian's, headless."""
    return {"executable_path": CHROMIUM, "headless": True}


def chromium_missing_reason() -> str | None:
    if Path(CHROMIUM).exists():
        return None
    return (
        f"{CHROMIUM} is missing: install Debian's package (`apt-get install chromium`; .ci/run does); "
        "no test downloads a browser"
    )


def seed(*, var_dir: Path) -> Seeded:
    """`make run`'s demo (admin and operator logins, demo tenant with credits and a key, the tiny
    demo model deployed with one replica, its member login the tenant's admin), plus a second
    tenant with a member and a key of its own, all with PASSWORD."""
    from controlplane.accounts.models import User
    from controlplane.accounts.selectors import user_get_by_username
    from controlplane.accounts.services import api_key_create, tenant_create, user_create, user_set_password
    from controlplane.billing.services import credit_grant, plan_create
    from controlplane.demo.seed import (
        ADMIN_USERNAME,
        MEMBER_USERNAME,
        MODEL_NAME,
        OPERATOR_USERNAME,
        TENANT_NAME,
        seed_demo,
    )

    # The demo model is written under the system's VAR_DIR, where its daemon and replicas read it.
    with override_settings(VAR_DIR=var_dir):
        demo = seed_demo(env_path=var_dir / ".env.demo")
    # The demo seeds the admin, operator and member logins (the member is its tenant's one
    # admin); the tests know them by PASSWORD.
    for username in (ADMIN_USERNAME, OPERATOR_USERNAME, MEMBER_USERNAME):
        user_set_password(user=user_get_by_username(username=username), password=PASSWORD)
    # The second tenant pays for every request (no monthly allowance), so its spend shows.
    pay_as_you_go = plan_create(name=PAY_AS_YOU_GO_PLAN, included_requests_per_month=0, rate_limit_per_minute=600)
    other = tenant_create(name=OTHER_TENANT_NAME, plan=pay_as_you_go)
    credit_grant(tenant=other, amount=Decimal("10.00"), memo="Browser tests")
    user_create(username="bob", password=PASSWORD, role=User.Role.TENANT_MEMBER, tenant=other)
    other_key = api_key_create(tenant=other, name="bob's key").api_key
    logins = {
        "admin": Login(ADMIN_USERNAME, PASSWORD, User.Role.ADMIN),
        "operator": Login(OPERATOR_USERNAME, PASSWORD, User.Role.OPERATOR),
        "tenant": Login(MEMBER_USERNAME, PASSWORD, User.Role.TENANT_MEMBER),
        "other_tenant": Login("bob", PASSWORD, User.Role.TENANT_MEMBER),
    }
    return Seeded(
        logins=logins,
        demo_model=MODEL_NAME,
        tenant_name=TENANT_NAME,
        other_tenant_name=other.name,
        other_tenant_key_id=other_key.pk,
        api_key=demo.api_key,
    )


def start_system(*, scratch: Path, redis_url: str) -> System:
    """Seed the current database, then start the control plane and one CPU daemon against it.

    The caller must allow database access (the seed writes, committed, so the subprocesses see it)
    and must call `stop()`; on a failed start everything already started is stopped here.
    """
    from controlplane.launcher import demo_environment

    fleet = Fleet(scratch, redis_url)
    # The daemon reports the checkpoints under the system's models folder, so the catalog can
    # check weight paths against it. Django runs as `make run` runs it (DEBUG off: the pages a
    # person sees, error pages included).
    fleet.env.update(
        demo_environment(var_dir=scratch / "var"), **SYSTEM_ENV, GPUSERVE_MODEL_ROOTS=str(scratch / "var" / "models")
    )
    seeded = seed(var_dir=scratch / "var")
    try:
        fleet.start_control_plane()
        fleet.start_daemon("browser")
    except BaseException:
        fleet.stop()
        raise
    return System(fleet, seeded)


def scratch_system_problem() -> str | None:
    """Why a script cannot start a scratch system here, or None when it can."""
    if not os.environ.get("DATABASE_URL", "").startswith("postgres") or not os.environ.get("REDIS_URL"):
        return "set DATABASE_URL (PostgreSQL) and REDIS_URL (a Redis database no running system uses)"
    return chromium_missing_reason()


@contextmanager
def scratch_system(name: str) -> Iterator[System]:
    """For scripts: set up Django, create a throwaway database `<DATABASE_URL's name>_<name>` and start
    the system in a temporary folder; afterwards stop it and drop the database and the folder.

    Check scratch_system_problem() first, to report a missing setting or browser as a usage error."""
    if problem := scratch_system_problem():
        raise RuntimeError(problem)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"{database['NAME']}_{name}"
    created = setup_databases(verbosity=0, interactive=False, aliases={"default"})
    try:
        with tempfile.TemporaryDirectory(prefix=f"gpuserve-{name}-") as scratch:
            system = start_system(scratch=Path(scratch), redis_url=os.environ["REDIS_URL"])
            try:
                yield system
            finally:
                system.stop()
    finally:
        connections.close_all()
        teardown_databases(created, verbosity=0)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


VIEWPORT = {"width": 1280, "height": 800}
# A phone held upright (an iPhone 12-15's CSS width); the layout holds from 360 px up.
PHONE_VIEWPORT = {"width": 390, "height": 844}


def horizontal_overflow(page) -> int:
    """How many CSS pixels the page is wider than its window (0: nothing scrolls sideways)."""
    return page.evaluate("document.documentElement.scrollWidth - window.innerWidth")


def log_in(page, login: Login) -> None:
    """Sign in through the login form, as a person would, and wait for the page it leads to."""
    page.goto("/accounts/login/")
    page.fill("#id_username", login.username)
    page.fill("#id_password", login.password)
    with page.expect_navigation():
        page.click("#login button[type=submit]")
    if page.url.rstrip("/").endswith("/accounts/login"):
        raise RuntimeError(f"logging in as {login.username} failed: {page.inner_text('main')[:300]}")
