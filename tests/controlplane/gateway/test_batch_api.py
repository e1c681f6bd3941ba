"""The Files and Batch APIs through the official `openai` SDK, against a gateway and a real Celery
worker (its own processes): a round trip, a bad line, a cancel, limits, tenants kept apart, and
a 2,000-line batch whose Celery worker and web server are killed mid-way and started again, with
every line charged once."""

import io
import json
import os
import select
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
from celery import Celery

from controlplane.batches.models import Batch, BatchFile
from controlplane.billing.models import CreditEntry, CreditHold, UsageRecord
from tests.controlplane.gateway.conftest import (
    REPO,
    WORKER_TOKEN,
    make_world,
    raw_connection,
    read_raw_response,
    start_gateway,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MAX_BYTES, MAX_LINES = 600_000, 2_500
BATCH_ENV = {
    "BATCH_MAX_FILE_BYTES": str(MAX_BYTES),
    "BATCH_MAX_FILE_LINES": str(MAX_LINES),
    "BATCH_CONCURRENCY": "8",
    "BATCH_TASK_SLICE_SECONDS": "2",
    "BATCH_LEASE_SECONDS": "6",
}


class CeleryWorker:
    """`celery -A controlplane worker` (solo pool: killing it kills the work) in its own process group."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlplane",
                "worker",
                "-P",
                "solo",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "WARNING",
            ],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def batch_env(database_url, tmp_path_factory):
    from tests.controlplane.gateway.conftest import _redis_url

    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": _redis_url(),
        "GPUSERVE_WORKER_TOKEN": WORKER_TOKEN,
        "DEBUG": "1",
        "LOG_LEVEL": "WARNING",
        "GATEWAY_ROUTING_REFRESH_MS": "100",
        "GATEWAY_RETRY_AFTER_SECONDS": "1",
        "BATCH_STORAGE_DIR": str(tmp_path_factory.mktemp("batch-files")),
        **BATCH_ENV,
    }


@pytest.fixture(scope="module")
def batch_gateway(replica_processes, gateway, batch_env, database_url):
    """A gateway with the batch limits above, on the shared gateway's Redis (so both see one
    routing of the replicas), and a Celery worker for the batch work."""
    overrides = {k: batch_env[k] for k in ("BATCH_STORAGE_DIR", *BATCH_ENV)}
    server = start_gateway(database_url, batch_env["REDIS_URL"], **overrides)
    server.overrides = overrides
    server.worker = CeleryWorker(batch_env)
    yield server
    server.worker.kill()
    server.stop()


# Uploads of several MB: far past the 1 MB a form parser keeps in memory before spooling to disk.
LARGE_MAX_BYTES = 32 * 1024 * 1024


@pytest.fixture(scope="module")
def large_upload_gateway(batch_gateway, batch_env, database_url, tmp_path_factory):
    """A gateway (on batch_gateway's Redis, so it routes the same replicas) taking uploads of
    several MB, with a storage folder of its own."""
    overrides = {
        "BATCH_STORAGE_DIR": str(tmp_path_factory.mktemp("large-files")),
        "BATCH_MAX_FILE_BYTES": str(LARGE_MAX_BYTES),
        "BATCH_MAX_FILE_LINES": "1000000",
    }
    server = start_gateway(database_url, batch_env["REDIS_URL"], **overrides)
    server.overrides = overrides
    yield server
    server.stop()


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat_lines(count: int, model: str, max_tokens: int = 2) -> list[dict]:
    return [
        {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": max_tokens},
        }
        for i in range(count)
    ]


def _poll(client, batch_id: str, until, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if until(batch):
            return batch
        time.sleep(0.3)
    pytest.fail(f"batch {batch_id} stayed {batch.status} ({batch.request_counts})")


def _ended(batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


def _batch_records(batch_id: str):
    return UsageRecord.objects.filter(request_id__startswith=f"{batch_id}:")


def test_a_batch_round_trip_with_the_sdk(batch_gateway, replicas):
    from tests.controlplane.factories import PlanFactory
    from tests.controlplane.gateway.test_tenancy_api import served_on

    plan = PlanFactory(rate_limit_per_minute=10_000, max_concurrent_requests=500, fair_share_weight=2)
    world = make_world(batch_gateway, replicas, plan=plan)
    client = world.client()
    uploaded = client.files.create(
        file=("requests.jsonl", io.BytesIO(_jsonl(_chat_lines(12, world.model.public_name)))), purpose="batch"
    )
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert uploaded.id in [f.id for f in client.files.list().data]
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "t"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "t"}
    done = _poll(client, batch.id, _ended)
    assert done.status == "completed", done.errors
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.error_file_id is None and done.completed_at >= done.in_progress_at
    results = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"request-{i}" for i in range(12))
    first = results[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert batch.id in [b.id for b in client.batches.list().data]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)  # completed
    # Billed once per line at the batch price (half the interactive 0.002), marked as batch work.
    records = _batch_records(batch.id)
    assert records.count() == 12 and set(records.values_list("batch", "price_charged")) == {(True, Decimal("0.001"))}
    assert CreditEntry.objects.filter(usage_record__in=records).count() == 12
    world.tenant.credit_account.refresh_from_db()
    assert world.tenant.credit_account.balance == Decimal("10") - Decimal("0.012")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(uploaded.id)
    assert uploaded.id not in [f.id for f in client.files.list().data]
    assert client.batches.retrieve(batch.id).input_file_id == uploaded.id  # the batch's record stays
    # The replicas served the lines as the tenant's batch work, at its plan's weight.
    served, weights = served_on(replicas)
    tenant = str(world.tenant.pk)
    assert served[tenant, "batch"] > 0 and (tenant, "interactive") not in served and weights[tenant] == 2.0


def test_a_responses_api_batch_answers_each_line_as_a_stored_response(batch_gateway, replicas):
    world = make_world(batch_gateway, replicas)
    client = world.client()
    bodies = [
        {"model": world.model.public_name, "input": "hello", "max_output_tokens": 2},
        {"model": world.model.public_name, "input": "hi", "instructions": "Be brief.", "max_output_tokens": 2},
        {"model": world.model.public_name, "input": "x", "previous_response_id": "resp_missing"},
    ]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": b} for i, b in enumerate(bodies)]
    uploaded = client.files.create(file=("responses.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    done = _poll(client, batch.id, _ended)
    assert done.status == "completed", done.errors
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    outputs = {o["custom_id"]: o for o in map(json.loads, client.files.content(done.output_file_id).text.splitlines())}
    assert sorted(outputs) == ["r0", "r1"]
    answer = outputs["r0"]["response"]["body"]
    assert answer["object"] == "response" and answer["output"][0]["type"] == "message"
    assert client.responses.retrieve(answer["id"]).id == answer["id"]  # stored, as store defaults to true
    (refused,) = map(json.loads, client.files.content(done.error_file_id).text.splitlines())
    assert refused["custom_id"] == "r2" and refused["response"]["status_code"] == 404
    assert refused["response"]["body"]["error"]["code"] == "previous_response_not_found"
    assert _batch_records(batch.id).count() == 2


def test_a_bad_line_fails_the_batch_with_its_errors_and_charges_nothing(batch_gateway, replicas):
    world = make_world(batch_gateway, replicas)
    client = world.client()
    lines = _chat_lines(5, world.model.public_name)
    lines[2]["body"]["temperature"] = "hot"
    raw = _jsonl(lines) + b"{not json\n"
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = _poll(client, batch.id, _ended)
    assert done.status == "failed" and done.failed_at
    errors = {error.line: error for error in done.errors.data}
    assert sorted(errors) == [3, 6]
    assert errors[3].param == "body.temperature" and errors[6].code == "invalid_json"
    assert not _batch_records(batch.id).exists() and not CreditHold.objects.filter(tenant=world.tenant).exists()
    world.tenant.credit_account.refresh_from_db()
    assert world.tenant.credit_account.balance == Decimal("10")


def test_a_cancel_mid_way_keeps_what_finished_charged_once(batch_gateway, replicas):
    world = make_world(batch_gateway, replicas)
    client = world.client()
    uploaded = client.files.create(
        file=("many.jsonl", io.BytesIO(_jsonl(_chat_lines(400, world.model.public_name, max_tokens=4)))),
        purpose="batch",
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    _poll(client, batch.id, lambda b: b.request_counts.completed >= 10)
    with pytest.raises(openai.ConflictError):  # the input of a batch still running
        client.files.delete(uploaded.id)
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = _poll(client, batch.id, _ended)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert 10 <= counts.completed < 400 and counts.completed + counts.failed == 400
    outputs = client.files.content(done.output_file_id).text.splitlines()
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert len(outputs) == counts.completed and len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    records = _batch_records(batch.id)
    assert records.count() == counts.completed
    assert CreditEntry.objects.filter(usage_record__in=records).count() == counts.completed


def test_file_limits_are_refused_with_the_limit_named(batch_gateway, replicas):
    world = make_world(batch_gateway, replicas)
    client = world.client()
    line = json.dumps(_chat_lines(1, world.model.public_name)[0]).encode() + b"\n"
    with pytest.raises(openai.APIStatusError) as error:
        client.files.create(file=("big.jsonl", io.BytesIO(line * (MAX_BYTES // len(line) + 10))), purpose="batch")
    assert error.value.status_code == 413 and f"{MAX_BYTES:,} bytes" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.files.create(file=("long.jsonl", io.BytesIO(b"{}\n" * (MAX_LINES + 1))), purpose="batch")
    assert f"{MAX_LINES:,} lines" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.files.create(file=("x.jsonl", io.BytesIO(line)), purpose="fine-tune")
    assert error.value.param == "purpose"
    uploaded = client.files.create(file=("ok.jsonl", io.BytesIO(line)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as error:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/images", completion_window="24h")
    assert error.value.param == "endpoint"
    with pytest.raises(openai.BadRequestError) as error:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert error.value.param == "completion_window"
    assert not Batch.objects.exists()


_BOUNDARY = "upload-boundary"
_MULTIPART_TAIL = f"\r\n--{_BOUNDARY}--\r\n".encode()


def _multipart_head(filename: str) -> bytes:
    """A multipart upload up to its file's bytes: the purpose field, then the file part's headers."""
    return (
        f'--{_BOUNDARY}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{_BOUNDARY}\r\ncontent-disposition: form-data; name="file"; filename="{filename}"\r\n'
        "content-type: application/jsonl\r\n\r\n"
    ).encode()


def _upload_head(world, headers: str) -> bytes:
    return (
        f"POST /v1/files HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {world.api_key.plaintext}\r\n"
        f"content-type: multipart/form-data; boundary={_BOUNDARY}\r\n{headers}\r\n"
    ).encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def test_a_chunked_upload_over_the_limit_is_413_without_reading_the_rest(batch_gateway, replicas):
    """No Content-Length: the gateway counts the bytes as they arrive and answers as soon as they
    pass the limit, with the error a declared length over it gets; the rest of the body (far more
    than the sockets hold) is never read, and nothing is stored."""
    world = make_world(batch_gateway, replicas)
    storage_dir = Path(batch_gateway.overrides["BATCH_STORAGE_DIR"])
    stored_before = set(storage_dir.iterdir())
    line = json.dumps(_chat_lines(1, world.model.public_name)[0]).encode() + b"\n"
    data = line * (65536 // len(line))
    body_bytes = 200 * MAX_BYTES
    with raw_connection(world.base_url) as sock:
        sock.sendall(_upload_head(world, f"content-length: {body_bytes}\r\n"))
        declared = read_raw_response(sock)
    sent = 0
    with raw_connection(world.base_url) as sock:
        sock.sendall(_upload_head(world, "transfer-encoding: chunked\r\n") + _chunk(_multipart_head("big.jsonl")))
        while sent < body_bytes:
            readable, writable, _ = select.select([sock], [sock], [], 60)
            assert readable or writable, "the gateway neither answered nor read for 60 s"
            if readable:  # the answer came before the body ended
                break
            try:
                sock.sendall(_chunk(data))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(data)
        else:
            sock.sendall(_chunk(_MULTIPART_TAIL) + b"0\r\n\r\n")
        status, headers, body = read_raw_response(sock)
    assert sent < body_bytes // 2, f"the gateway read {sent:,} of {body_bytes:,} bytes before answering"
    assert (status, body) == (declared[0], declared[2]) and status == 413, body
    error = json.loads(body)["error"]
    assert error["code"] == "file_too_large" and f"{MAX_BYTES:,} bytes" in error["message"]
    assert headers["connection"] == "close"
    assert not BatchFile.objects.filter(tenant=world.tenant).exists()
    assert set(storage_dir.iterdir()) == stored_before
    world.tenant.credit_account.refresh_from_db()
    assert world.tenant.credit_account.balance == Decimal("10")


def test_a_chunked_upload_under_the_limit_is_stored(batch_gateway, replicas):
    world = make_world(batch_gateway, replicas)
    raw = _jsonl(_chat_lines(200, world.model.public_name))

    def body():
        yield _multipart_head("chunked.jsonl")
        for start in range(0, len(raw), 4096):
            yield raw[start : start + 4096]
        yield _MULTIPART_TAIL

    response = httpx.post(
        f"{world.base_url}/v1/files",
        content=body(),
        headers={
            "authorization": f"Bearer {world.api_key.plaintext}",
            "content-type": f"multipart/form-data; boundary={_BOUNDARY}",
        },
        timeout=60,
    )
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in response.request.headers
    assert response.status_code == 200, response.text
    uploaded = response.json()
    assert (uploaded["bytes"], uploaded["filename"]) == (len(raw), "chunked.jsonl")
    assert world.client().files.content(uploaded["id"]).content == raw


def test_another_tenant_cannot_see_a_file_or_batch(batch_gateway, replicas):
    mine, theirs = make_world(batch_gateway, replicas), make_world(batch_gateway, replicas)
    client = mine.client()
    uploaded = client.files.create(
        file=("r.jsonl", io.BytesIO(_jsonl(_chat_lines(2, mine.model.public_name)))), purpose="batch"
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = theirs.client()
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.files.list().data == [] and other.batches.list().data == []
    _poll(client, batch.id, _ended)


def test_a_2000_line_batch_survives_its_worker_and_web_server_killed_charging_each_line_once(
    batch_gateway, replicas, batch_env, database_url
):
    world = make_world(batch_gateway, replicas, credit=Decimal("100"))
    client = world.client()
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": world.model.public_name, "prompt": f"p{i}", "max_tokens": 1},
        }
        for i in range(2000)
    ]
    uploaded = client.files.create(file=("2k.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    _poll(client, batch.id, lambda b: b.request_counts.completed >= 300, timeout=600)
    batch_gateway.worker.kill()  # mid-line: holds placed, answers not yet settled
    batch_gateway.process.kill()  # and the web server
    batch_gateway.process.wait(timeout=10)
    before = Batch.objects.get(public_id=batch.id).completed
    assert before < 2000
    batch_gateway.worker = CeleryWorker(batch_env)
    web = start_gateway(database_url, batch_env["REDIS_URL"], **batch_gateway.overrides)
    client = world.client().with_options(base_url=f"{web.url}/v1")
    # What beat sends every BATCH_RESUME_INTERVAL_SECONDS; the dead runner's lease runs out first.
    beat = Celery(broker=batch_env["REDIS_URL"])
    deadline = time.monotonic() + 900
    try:
        while not _ended(done := client.batches.retrieve(batch.id)) and time.monotonic() < deadline:
            beat.send_task("controlplane.batches.resume")
            time.sleep(2)
        custom_ids = [
            json.loads(line)["custom_id"] for line in client.files.content(done.output_file_id).text.splitlines()
        ]
    finally:
        web.stop()
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (2000, 0)
    assert sorted(custom_ids) == sorted(f"line-{i}" for i in range(2000))
    records = _batch_records(batch.id)
    assert records.count() == 2000
    assert CreditEntry.objects.filter(usage_record__in=records).count() == 2000
    wait_until(lambda: not CreditHold.objects.filter(tenant=world.tenant).exists(), 10, "no hold left")
    world.tenant.credit_account.refresh_from_db()
    assert world.tenant.credit_account.balance == Decimal("100") - 2000 * Decimal("0.001")
    assert world.tenant.credit_account.held == 0


def _bytes_written(process: subprocess.Popen) -> int:
    """All a process has written so far, to files and sockets alike (the kernel's count)."""
    io_counts = dict(line.split(": ") for line in Path(f"/proc/{process.pid}/io").read_text().splitlines())
    return int(io_counts["wchar"])


def _file_then_purpose(filename: str, data: bytes, purpose: str) -> bytes:
    """A multipart upload with the file part first and the purpose field after it."""
    return (
        (
            f'--{_BOUNDARY}\r\ncontent-disposition: form-data; name="file"; filename="{filename}"\r\n'
            "content-type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + (f'\r\n--{_BOUNDARY}\r\ncontent-disposition: form-data; name="purpose"\r\n\r\n{purpose}').encode()
        + _MULTIPART_TAIL
    )


def test_a_large_upload_is_written_once_as_it_arrives_with_its_purpose_after_it(large_upload_gateway, replicas):
    """Several MB, the purpose after the file part: stored byte for byte, the gateway writing about
    the file's size in all (a form parser that spools the part to a temporary file first writes it
    twice); a wrong purpose after the file leaves neither its bytes nor a row."""
    world = make_world(large_upload_gateway, replicas)
    storage_dir = Path(large_upload_gateway.overrides["BATCH_STORAGE_DIR"])
    raw = _jsonl(_chat_lines(40_000, world.model.public_name))
    assert 6_000_000 < len(raw) < LARGE_MAX_BYTES

    def upload(purpose: str) -> httpx.Response:
        return httpx.post(
            f"{world.base_url}/v1/files",
            content=_file_then_purpose("large.jsonl", raw, purpose),
            headers={
                "authorization": f"Bearer {world.api_key.plaintext}",
                "content-type": f"multipart/form-data; boundary={_BOUNDARY}",
            },
            timeout=120,
        )

    before = _bytes_written(large_upload_gateway.process)
    response = upload("batch")
    written = _bytes_written(large_upload_gateway.process) - before
    assert response.status_code == 200, response.text
    uploaded = response.json()
    assert (uploaded["bytes"], uploaded["filename"], uploaded["purpose"]) == (len(raw), "large.jsonl", "batch")
    assert len(raw) <= written < 1.25 * len(raw), f"{written:,} bytes written for a {len(raw):,}-byte upload"
    assert world.client().files.content(uploaded["id"]).content == raw
    stored = set(storage_dir.iterdir())
    assert [path.name for path in stored] == [uploaded["id"]]

    response = upload("fine-tune")
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose", response.text
    assert set(storage_dir.iterdir()) == stored
    assert list(BatchFile.objects.filter(tenant=world.tenant).values_list("public_id", flat=True)) == [uploaded["id"]]


def test_a_client_gone_mid_upload_leaves_no_file_and_no_row(large_upload_gateway, replicas):
    """The file part's bytes reach storage as they arrive (its partial file grows while the client
    still sends); the client goes mid-way, and the partial file goes too, with no row written."""
    world = make_world(large_upload_gateway, replicas)
    storage_dir = Path(large_upload_gateway.overrides["BATCH_STORAGE_DIR"])
    before = set(storage_dir.iterdir())
    line = json.dumps(_chat_lines(1, world.model.public_name)[0]).encode() + b"\n"
    data = line * (65536 // len(line))

    def partial_over(size: int) -> bool:
        return any(path.suffix == ".partial" and path.stat().st_size > size for path in storage_dir.iterdir())

    with raw_connection(world.base_url) as sock:
        sock.sendall(_upload_head(world, f"content-length: {LARGE_MAX_BYTES}\r\n") + _multipart_head("gone.jsonl"))
        for _ in range(3 * 1024 * 1024 // len(data)):
            sock.sendall(data)
        wait_until(lambda: partial_over(1024 * 1024), 30, "the upload's bytes in storage as they arrive")
    wait_until(lambda: set(storage_dir.iterdir()) == before, 30, "the partial file removed")
    assert not BatchFile.objects.filter(tenant=world.tenant).exists()
