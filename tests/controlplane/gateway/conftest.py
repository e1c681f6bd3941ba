"""The running system for the gateway tests: real replica servers (`python -m gpuworker serve` on
CPU with a tiny checkpoint) and the control plane's ASGI app served by uvicorn in its own
process, against the test database and a Redis database of its own. Tests drive it with the
official `openai` SDK.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from tests.conftest import require_service
from tests.processes import stop_process_tree

WORKER_TOKEN = "gateway-tests-worker-token"
REPO = Path(__file__).resolve().parents[3]
# The gateway's shared state (rate limits, in-flight sets) goes to its own Redis database, so
# these tests neither see nor disturb other suites' keys (GATEWAY_TESTS_REDIS_DB picks another, so
# that several checkouts can run them on one Redis at once).
REDIS_DB = int(os.environ.get("GATEWAY_TESTS_REDIS_DB", "13"))
# Prompts must fit the replicas' 256-token context (one token per byte with the test tokenizer).
AFFINITY_PREFIX_CHARS = 64


def raw_connection(base_url: str) -> socket.socket:
    """A plain socket to the gateway, for requests an HTTP client would not send as they are (a
    declared length with no body, a body that never ends)."""
    parts = urlsplit(base_url)
    return socket.create_connection((parts.hostname, parts.port), timeout=60)  # a deadline, not a measure


def answer_one_request(sock: socket.socket, answer: bytes) -> None:
    """A stand-in replica's side of one connection: read one request with a Content-Length, send
    `answer` as it is (status line, headers and body, however malformed), then close."""
    data = b""
    while b"\r\n\r\n" not in data:
        if not (received := sock.recv(65536)):
            return
        data += received
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    sock.sendall(answer)
    sock.shutdown(socket.SHUT_RDWR)


def read_raw_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed without a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@dataclass
class ReplicaServer:
    url: str
    process: subprocess.Popen

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


def start_replica(
    checkpoint: Path, name: str, *, max_model_len: int | None = 256, env: dict[str, str] | None = None
) -> ReplicaServer:
    """A real replica process (`python -m gpuworker serve`) on a free port; `env` replaces the
    environment (None: this process's)."""
    port = free_port()
    length = ["--max-model-len", str(max_model_len)] if max_model_len is not None else []
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuworker",
            "serve",
            "--model",
            str(checkpoint),
            "--port",
            str(port),
            "--token",
            WORKER_TOKEN,
            "--served-model-name",
            name,
            *length,
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    return ReplicaServer(f"http://127.0.0.1:{port}", process)


def wait_ready(replica: ReplicaServer, timeout: float = 600) -> None:
    """Until the replica answers /health; generous, as a loaded CI machine loads models slowly."""
    headers = {"Authorization": f"Bearer {WORKER_TOKEN}"}

    def ready():
        if replica.process.poll() is not None:
            pytest.fail(f"replica at {replica.url} exited with {replica.process.returncode}")
        return httpx.get(f"{replica.url}/health", headers=headers, timeout=2).status_code == 200

    wait_until(ready, timeout, f"the replica at {replica.url}")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    from tests.gpuworker.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("gateway-checkpoint"), "llama")


@pytest.fixture(scope="session")
def replica_processes(checkpoint):
    """Two replica servers of the tiny model for the whole session (loading them takes a while
    on two cores, so they load while the test database is set up)."""
    servers = [start_replica(checkpoint, "tiny") for _ in range(2)]
    try:
        yield servers
    finally:
        for server in servers:
            server.kill()


@pytest.fixture
def replicas(replica_processes, gateway):
    for server in replica_processes:
        if server.process.poll() is not None:
            pytest.fail(f"the replica at {server.url} has died")
        wait_ready(server)
    yield replica_processes
    # Settlements are written just after answers go out: wait for them before the test's tables
    # are emptied (a TRUNCATE racing a settlement's row locks would deadlock).
    from controlplane.billing.models import CreditHold

    wait_until(lambda: not CreditHold.objects.exists(), 15, "every request to be settled")


def _database_url() -> str:
    from django.db import connection

    if connection.vendor != "postgresql":
        require_service(f"the database is {connection.vendor}; the gateway tests need PostgreSQL (set DATABASE_URL)")
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _redis_url() -> str:
    base = os.environ.get("REDIS_URL", "")
    if not base:
        require_service("REDIS_URL is not set")
    return base.rsplit("/", 1)[0] + f"/{REDIS_DB}" if base.count("/") > 2 else f"{base}/{REDIS_DB}"


@dataclass
class GatewayServer:
    url: str
    redis_url: str
    process: subprocess.Popen

    def stop(self) -> None:
        stop_process_tree(self.process)


def start_module_gateway(database_url: str, *, log=None) -> GatewayServer:
    """A test module's own gateway on the Redis database of REDIS_URL (emptied first), so that it
    neither needs nor disturbs the shared gateway fixture's replicas and keys; `log`: a file its
    log (stderr) goes to, for a test that reads it."""
    redis_url = os.environ["REDIS_URL"]
    redis.Redis.from_url(redis_url).flushdb()
    return start_gateway(database_url, redis_url, log=log)


def start_gateway(
    database_url: str, redis_url: str, *, workers: int = 1, log=None, as_launched: bool = False, **env_overrides: str
) -> GatewayServer:
    """uvicorn serving controlplane.asgi in its own process (`workers` processes behind one port,
    as docker-compose runs it), as in production; waits until it answers. `log`: a file for its
    stderr (None: this process's). `as_launched`: the web process as `make run` starts it
    (launcher.process_specs), waited for until it listens, with no request sent to it."""
    from controlplane.launcher import port_answers, process_specs

    port = free_port()
    (web,) = [spec for spec in process_specs(host="127.0.0.1", port=port) if spec.name == "web"]
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "GPUSERVE_WORKER_TOKEN": WORKER_TOKEN,
        "DEBUG": "1",
        "LOG_LEVEL": "WARNING",
        # Small figures so that the tests see routing changes, waits and cool-downs quickly.
        "GATEWAY_ROUTING_REFRESH_MS": "100",
        "GATEWAY_COLD_START_WAIT_SECONDS": "2",
        "GATEWAY_RETRY_AFTER_SECONDS": "3",
        "GATEWAY_REPLICA_COOLDOWN_SECONDS": "30",
        "GATEWAY_HOLD_SWEEP_SECONDS": "1",
        "GATEWAY_AFFINITY_PREFIX_CHARS": str(AFFINITY_PREFIX_CHARS),
        # Uploaded batch files go to a folder of this gateway's, not the checkout's var/.
        "BATCH_STORAGE_DIR": tempfile.mkdtemp(prefix="batch-files-"),
        **(web.env if as_launched else {}),
        **env_overrides,
    }
    argv = (
        web.argv
        if as_launched
        else [
            sys.executable,
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--workers",
            str(workers),
        ]
    )
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stderr=log)
    server = GatewayServer(f"http://127.0.0.1:{port}", redis_url, process)
    # A /v1 request builds the process's Gateway: one started as launched must do without it.
    answers = (
        (lambda: port_answers("127.0.0.1", port))
        if as_launched
        else (lambda: httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 401)
    )
    try:
        wait_until(answers, 60, "the gateway")
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def database_url(django_db_setup, django_db_blocker) -> str:
    """The test database, for the gateway processes."""
    with django_db_blocker.unblock():
        return _database_url()


@pytest.fixture(scope="session")
def gateway(replica_processes, database_url):
    redis_url = _redis_url()
    redis.Redis.from_url(redis_url).flushdb()
    # Its claims on background responses last an hour, so that it looks for orphans that rarely:
    # the tests of taking them over start the processes that must take them.
    server = start_gateway(database_url, redis_url, GATEWAY_BACKGROUND_LEASE_SECONDS="3600")
    yield server
    server.stop()


@dataclass
class World:
    """One tenant with a key, credit and a plan, and a model served by the replicas."""

    tenant: object
    api_key: object
    model: object
    replicas: list
    base_url: str

    def settled(self, timeout: float = 10.0) -> None:
        """Wait until the tenant's requests are settled: settlement is written just after the
        answer goes out, off the client's latency."""
        from controlplane.billing.models import CreditHold

        wait_until(
            lambda: not CreditHold.objects.filter(tenant=self.tenant).exists(), timeout, "the requests to be settled"
        )

    def client(self, api_key: str | None = None, **options):
        import openai

        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or self.api_key.plaintext,
            **{"max_retries": 0, "timeout": 60, **options},
        )

    def async_client(self, api_key: str | None = None, **options):
        import openai

        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key or self.api_key.plaintext,
            **{"max_retries": 0, "timeout": 60, **options},
        )

    def chats_at_once(self, count: int, api_key: str | None = None) -> list[str]:
        """`count` one-token chat completions released at the same moment: "served" for each
        answered, the error code for each refused with a 429."""
        import openai

        async def fire() -> list[str]:
            client = self.async_client(api_key)
            start = asyncio.Event()

            async def one() -> str:
                await start.wait()
                try:
                    await client.chat.completions.create(
                        model=self.model.public_name, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
                    )
                    return "served"
                except openai.RateLimitError as error:
                    return error.code

            tasks = [asyncio.ensure_future(one()) for _ in range(count)]
            await asyncio.sleep(0.1)
            start.set()
            outcomes = await asyncio.gather(*tasks)
            await client.close()
            return outcomes

        return asyncio.run(fire())


def assert_answers_with_engine_text(world: World, checkpoint: Path, prompt: list[int], max_tokens: int = 8) -> None:
    """A greedy completion of `prompt` through the gateway has the text our engine gives on
    `checkpoint` by itself, and is billed once, per request."""
    from controlplane.billing.models import UsageRecord
    from gpuworker.engine import LLMEngine, SamplingParams

    response = world.client().completions.with_raw_response.create(
        model=world.model.public_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    completion = response.parse()
    assert completion.usage.completion_tokens == max_tokens
    assert completion.choices[0].finish_reason == "length"
    engine = LLMEngine(checkpoint, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert completion.choices[0].text == engine.generate([prompt], params)[0].text
    world.settled()
    record = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert record.status == "completed" and record.price_charged > Decimal("0")


def make_world(
    gateway, servers, *, credit=Decimal("10"), price=Decimal("0.002"), plan=None, kind="chat", **key_fields
) -> World:
    """Rows for a tenant and a model whose ready replicas are `servers`; waits until the gateway
    routes the model."""
    from controlplane.billing.services import credit_grant
    from controlplane.fleet.models import Replica, Worker
    from tests.controlplane.factories import (
        ApiKeyFactory,
        DeploymentFactory,
        ModelFactory,
        PlanFactory,
        PriceTierFactory,
        TenantFactory,
    )

    plan = plan or PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=500)
    tenant = TenantFactory(plan=plan)
    if credit:
        credit_grant(tenant=tenant, amount=credit)
    api_key = ApiKeyFactory(tenant=tenant, **key_fields)
    model = ModelFactory(price_tier=PriceTierFactory(price_per_request=price), context_length=256, kind=kind)
    deployment = DeploymentFactory(model=model, desired_replicas=len(servers), max_replicas=max(2, len(servers)))
    worker = Worker.objects.create(
        name=f"host-{model.pk}",
        queue_name=f"gpuworker.host-{model.pk}",
        advertise_host="127.0.0.1",
        device=Worker.Device.CPU,
    )
    rows = [
        Replica.objects.create(deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=server.url)
        for server in servers
    ]
    world = World(tenant, api_key, model, rows, gateway.url)
    probe = ApiKeyFactory(tenant=tenant, rate_limit_per_minute=10_000)  # may see every model
    headers = {"Authorization": f"Bearer {probe.plaintext}"}
    wait_until(
        lambda: any(
            m["id"] == model.public_name
            for m in httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=5).json()["data"]
        ),
        10,
        f"the gateway to route {model.public_name}",
    )
    return world


def orphaned_background_response(world: World, *, max_output_tokens: int = 4):
    """A queued background response as a gateway process that died left it: its claim ran out."""
    from django.utils import timezone

    from controlplane.gateway.models import StoredResponse
    from controlplane.gateway.stored_responses import BackgroundRun, stored_response_save

    response_id, request_id = f"resp_{uuid.uuid4().hex}", f"req_{uuid.uuid4().hex}"
    body = {"model": world.model.public_name, "input": "Hello", "max_output_tokens": max_output_tokens}
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}
    queued = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "queued"}
    stored_response_save(
        tenant_id=world.tenant.pk,
        response_id=response_id,
        input_items=[item],
        history=[item],
        response=queued,
        background=BackgroundRun(
            request=json.dumps({**body, "background": True}),
            api_key_id=world.api_key.pk,
            request_id=request_id,
            owner=f"dead-process-{uuid.uuid4().hex}",
        ),
    )
    StoredResponse.objects.filter(pk=response_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    return StoredResponse.objects.get(pk=response_id)


def background_response_finished(response_id: str, timeout: float = 60.0):
    """The background response once it is no longer queued or in progress."""
    from controlplane.gateway.models import StoredResponse

    wait_until(
        lambda: StoredResponse.objects.get(pk=response_id).status not in ("queued", "in_progress"),
        timeout,
        f"background response {response_id} to be run again",
    )
    return StoredResponse.objects.get(pk=response_id)
