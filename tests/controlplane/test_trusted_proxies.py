"""The client address behind proxies, through the stack as it ships: uvicorn configured by the
command lines of the launcher, docker-compose.yml and the Dockerfile, then controlplane.asgi, the
real login view, django-axes and the audit log, on the real database.

Only a peer listed in TRUSTED_PROXIES may name the client in X-Forwarded-For; anyone else's header
is ignored, so a new header per try cannot reset a lockout."""

import json
import uuid
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from asgiref.sync import async_to_sync
from axes.models import AccessAttempt
from django.urls import reverse
from uvicorn.main import main as uvicorn_command_line

from controlplane.accounts.models import User
from controlplane.accounts.services import user_create
from controlplane.audit.models import AuditEntry
from controlplane.env import parse_networks
from controlplane.launcher import process_specs
from tests.controlplane.factories import ModelFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the ASGI handler opens connections of its own

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "a-long-right-password-7"
LIMIT = 5  # LOGIN_FAILURE_LIMIT's default
LOGIN = reverse("login")
ATTACKER, CLIENT, OTHER_CLIENT = "203.0.113.7", "198.51.100.23", "198.51.100.24"


def _uvicorn_args(argv: list[str]) -> list[str]:
    return argv[argv.index("uvicorn") + 1 :] if "uvicorn" in argv else argv[argv.index("-m") + 2 :]


def _launcher_command() -> list[str]:
    web = next(spec for spec in process_specs(host="127.0.0.1", port=8000) if spec.name == "web")
    return _uvicorn_args(web.argv)


def _compose_file() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def _compose_command() -> list[str]:
    return _uvicorn_args(_compose_file()["services"]["web"]["command"])


def _dockerfile_command() -> list[str]:
    lines = (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()  # continuations joined
    line = next(line for line in lines if line.startswith("CMD "))
    return _uvicorn_args(json.loads(line[len("CMD ") :]))


SERVERS = {"launcher": _launcher_command, "docker-compose": _compose_command, "Dockerfile": _dockerfile_command}


def _served_app(args: list[str]):
    """controlplane.asgi as uvicorn serves it with this command line (its proxy-header middleware
    included when the command line turns it on)."""
    from controlplane.asgi import application

    params = uvicorn_command_line.make_context("uvicorn", list(args)).params
    config = uvicorn.Config(
        application,
        proxy_headers=params["proxy_headers"],
        forwarded_allow_ips=params["forwarded_allow_ips"],
        lifespan="off",
        log_config=None,
    )
    config.load()
    return config.loaded_app


class Browser:
    """One client of the served app, connecting from `peer`, with its own cookies."""

    def __init__(self, app, peer: str):
        transport = httpx.ASGITransport(app=app, client=(peer, 40000))
        self._http = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")

    def post(self, path: str, data: dict, forwarded_for: str | bytes | None = None) -> httpx.Response:
        return async_to_sync(self._post)(path, data, forwarded_for)

    async def _post(self, path, data, forwarded_for):
        headers = {"X-Forwarded-For": forwarded_for} if forwarded_for is not None else {}
        if "csrftoken" not in self._http.cookies:
            await self._http.get(LOGIN, headers=headers)
        data = {**data, "csrfmiddlewaretoken": self._http.cookies["csrftoken"]}
        return await self._http.post(path, data=data, headers=headers)

    def log_in(self, password: str, forwarded_for: str | bytes | None = None) -> int:
        return self.post(LOGIN, {"username": "ada", "password": password}, forwarded_for).status_code


def _spoof() -> str:
    """A new address each time, as the attacker sends."""
    return f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}"


@pytest.fixture
def ada():
    return user_create(username="ada", password=PASSWORD, role=User.Role.ADMIN)


@pytest.fixture(autouse=True)
def _no_uvicorn_environment(monkeypatch):
    # uvicorn reads its trusted list from here when the command line names none.
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)


# Each shipped command line, with a peer its uvicorn would have believed: the launcher's and the
# image's uvicorn trust loopback by default, and compose's trusted everyone.
@pytest.mark.parametrize(
    ("server", "peer"), [("launcher", "127.0.0.1"), ("Dockerfile", "127.0.0.1"), ("docker-compose", ATTACKER)]
)
def test_a_new_forwarded_for_each_try_does_not_reset_the_lockout(ada, server, peer):
    browser = Browser(_served_app(SERVERS[server]()), peer)
    answers = [browser.log_in(f"wrong-{i}", forwarded_for=_spoof()) for i in range(LIMIT)]
    assert answers == [200] * (LIMIT - 1) + [429]
    assert browser.log_in(PASSWORD, forwarded_for=_spoof()) == 429  # the right password, still locked
    assert browser.log_in(PASSWORD) == 429
    assert list(AccessAttempt.objects.values_list("ip_address", flat=True)) == [peer]


def test_a_spoofed_header_from_an_untrusted_peer_is_ignored(ada, settings):
    settings.TRUSTED_PROXIES = parse_networks("TRUSTED_PROXIES", "172.16.238.1")
    browser = Browser(_served_app(_compose_command()), ATTACKER)
    # Even a header that names a trusted proxy as the last hop.
    assert browser.log_in("wrong", forwarded_for=f"{CLIENT}, 172.16.238.1") == 200
    assert AccessAttempt.objects.get().ip_address == ATTACKER


def test_behind_the_trusted_proxy_the_forwarded_client_is_locked_out_and_audited(ada, settings):
    """The proxy appends the address it saw to whatever the client sent: the right-most address
    that is not a trusted proxy is the client, for the lockout and the audit log alike."""
    gateway = _compose_file()["networks"]["default"]["ipam"]["config"][0]["gateway"]
    settings.TRUSTED_PROXIES = parse_networks("TRUSTED_PROXIES", gateway)
    app = _served_app(_compose_command())
    attacker, client = Browser(app, gateway), Browser(app, gateway)

    answers = [attacker.log_in(f"wrong-{i}", forwarded_for=f"{_spoof()}, {CLIENT}") for i in range(LIMIT)]
    assert answers[-1] == 429
    assert attacker.log_in(PASSWORD, forwarded_for=f"{_spoof()}, {CLIENT}") == 429
    assert AccessAttempt.objects.get().ip_address == CLIENT

    # Another client behind the same proxy is not the one locked out: it logs in and acts.
    assert client.log_in(PASSWORD, forwarded_for=OTHER_CLIENT) == 302
    model = ModelFactory(enabled=True)
    answer = client.post(
        reverse("dashboard:catalog_set_enabled", args=[model.pk]),
        {"enabled": "0"},
        forwarded_for=f"{_spoof()}, {OTHER_CLIENT}",
    )
    assert answer.status_code == 302
    entry = AuditEntry.objects.get(action=AuditEntry.Action.MODEL_DISABLE)
    assert (entry.actor_label, entry.source_address) == ("ada", OTHER_CLIENT)


MALFORMED = [
    "",
    ",",
    "not-an-address",
    "unknown",
    "999.1.1.1",
    "198.51.100.23, ,",
    "[::1",
    "[2001:db8::1]:x",
    "::ffff:zz",
    "1.2.3.4:99999999999999999999",
    "\u00e9t\u00e9".encode("latin-1"),
    b"\xff\xfe",
    "a" * 4000,
    ", ".join(["198.51.100.23"] * 500),
]


def test_a_malformed_header_is_no_500(ada, settings):
    settings.TRUSTED_PROXIES = parse_networks("TRUSTED_PROXIES", "127.0.0.1")
    app = _served_app(_launcher_command())
    for header in MALFORMED:
        browser = Browser(app, "127.0.0.1")
        answers = [browser.log_in("wrong", forwarded_for=header), browser.log_in(PASSWORD, forwarded_for=header)]
        assert answers == [200, 302], header  # the failure counted, then the right password let in
