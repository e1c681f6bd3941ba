"""Batches' services against the real database: validation into lines, each line charged once at
the batch price with its answer, expiry keeping what finished, the runner's lease."""

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.batches import storage
from controlplane.batches.models import Batch, BatchFile, BatchLine
from controlplane.batches.services import (
    BatchRefused,
    batch_claim,
    batch_create,
    batch_file_create,
    batch_file_upload_finish,
    batch_file_upload_start,
    batch_finish,
    batch_line_hold,
    batch_line_settle,
    batch_validate,
    batches_resume,
)
from controlplane.billing.holds import HoldRefused, RequestOutcome
from controlplane.billing.models import CreditHold, UsageRecord
from controlplane.billing.pricing import batch_price
from controlplane.billing.services import credit_grant
from tests.controlplane.factories import ModelFactory, PriceTierFactory, TenantFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def storage_dir(settings, tmp_path):
    settings.BATCH_STORAGE_DIR = str(tmp_path / "batch-files")
    settings.BATCH_MAX_FILE_BYTES, settings.BATCH_MAX_FILE_LINES = 10_000, 20


@pytest.fixture
def model():
    return ModelFactory(public_name="tiny", price_tier=PriceTierFactory(price_per_request=Decimal("0.004")))


@pytest.fixture
def tenant():
    tenant = TenantFactory()
    credit_grant(tenant=tenant, amount=Decimal("1"))
    return tenant


def _lines(count: int, model: str = "tiny") -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": model, "prompt": "hi", "max_tokens": 1},
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


def _started_batch(tenant, count: int, *, raw: bytes | None = None, endpoint: str = "/v1/completions") -> Batch:
    """A validated batch of `count` completion lines, or of the lines `raw` for `endpoint`."""
    chunk = _lines(count) if raw is None else raw
    file = batch_file_create(tenant_id=tenant.pk, filename="in.jsonl", purpose="batch", chunks=[chunk])
    batch = batch_create(
        tenant_id=tenant.pk,
        api_key_id=None,
        input_file=file,
        endpoint=endpoint,
        completion_window="24h",
        metadata=None,
        now=timezone.now(),
    )
    return batch_validate(batch_id=batch.pk, now=timezone.now())


def _answer(line: BatchLine, model) -> bool:
    now = timezone.now()
    hold = batch_line_hold(
        line=line, tenant_id=line.batch.tenant_id, api_key_id=None, model_id=model.pk, price=Decimal("0.002"), now=now
    )
    assert not isinstance(hold, HoldRefused)
    return batch_line_settle(
        line_id=line.pk,
        outcome=RequestOutcome(
            line.request_id, UsageRecord.Status.COMPLETED, prompt_tokens=2, completion_tokens=1, batch=True
        ),
        status_code=200,
        response={"object": "text_completion", "choices": [{"text": "x"}]},
        error=None,
        now=now,
    )


def test_validation_records_every_line_with_its_usage_key(tenant):
    batch = _started_batch(tenant, 3)
    assert (batch.status, batch.total, batch.model_name) == ("in_progress", 3, "tiny")
    assert list(batch.lines.values_list("custom_id", "request_id")) == [
        (f"c{i}", f"{batch.public_id}:{i + 1}") for i in range(3)
    ]


def test_an_expired_batch_keeps_what_finished_and_fails_the_rest_unbilled(tenant, model):
    batch = _started_batch(tenant, 5)
    for line in batch.lines.order_by("line_number")[:2]:
        assert _answer(line, model)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    batch = batch_finish(batch_id=batch.pk, now=timezone.now())
    assert (batch.status, batch.completed, batch.failed) == ("expired", 2, 3) and batch.expired_at
    outputs = [json.loads(x) for x in storage.read_lines(batch.output_file.storage_name)]
    errors = [json.loads(x) for x in storage.read_lines(batch.error_file.storage_name)]
    assert [o["custom_id"] for o in outputs] == ["c0", "c1"] and outputs[0]["response"]["status_code"] == 200
    assert [e["custom_id"] for e in errors] == ["c2", "c3", "c4"]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and errors[0]["response"] is None
    records = UsageRecord.objects.filter(tenant=tenant)
    assert list(records.values_list("batch", "price_charged")) == [(True, Decimal("0.002"))] * 2
    tenant.credit_account.refresh_from_db()
    assert (tenant.credit_account.balance, tenant.credit_account.held) == (Decimal("0.996"), 0)


def test_a_batch_whose_lines_all_finished_completes_even_past_its_window(tenant, model):
    batch = _started_batch(tenant, 1)
    assert _answer(batch.lines.get(), model)
    Batch.objects.filter(pk=batch.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert batch_finish(batch_id=batch.pk, now=timezone.now()).status == "completed"


def test_a_second_validation_leaves_a_started_batch_alone(tenant):
    batch = _started_batch(tenant, 2)
    line_ids = list(batch.lines.values_list("pk", flat=True))
    assert batch_validate(batch_id=batch.pk, now=timezone.now()).status == "in_progress"
    assert list(batch.lines.values_list("pk", flat=True)) == line_ids


def test_a_line_settled_by_two_runners_is_charged_once(tenant, model):
    line = _started_batch(tenant, 1).lines.get()
    assert _answer(line, model)
    # A runner whose lease ran out sends the line again: its hold is released, nothing written.
    assert not _answer(BatchLine.objects.get(pk=line.pk), model)
    assert UsageRecord.objects.filter(request_id=line.request_id).count() == 1
    tenant.credit_account.refresh_from_db()
    assert (tenant.credit_account.balance, tenant.credit_account.held) == (Decimal("0.998"), 0)


def test_a_hold_left_by_a_dead_runner_is_released_before_the_line_is_sent_again(tenant, model):
    line = _started_batch(tenant, 1).lines.get()
    for _ in range(2):
        batch_line_hold(
            line=line,
            tenant_id=tenant.pk,
            api_key_id=None,
            model_id=model.pk,
            price=Decimal("0.002"),
            now=timezone.now(),
        )
    assert CreditHold.objects.filter(request_id=line.request_id).count() == 1
    tenant.credit_account.refresh_from_db()
    assert tenant.credit_account.held == Decimal("0.002")


def test_a_batch_has_one_runner_at_a_time_and_a_dead_ones_lease_runs_out(tenant, settings):
    batch = _started_batch(tenant, 1)
    now = timezone.now()
    assert batch_claim(batch_id=batch.pk, owner="a", now=now) is not None
    assert batch_claim(batch_id=batch.pk, owner="b", now=now) is None
    assert batch_claim(batch_id=batch.pk, owner="a", now=now) is not None  # renewed
    assert batches_resume(now=now) == []
    later = now + timedelta(seconds=settings.BATCH_LEASE_SECONDS + 1)
    assert batch_claim(batch_id=batch.pk, owner="b", now=later) is not None


def test_file_limits_leave_nothing_behind(tenant, tmp_path):
    with pytest.raises(storage.FileTooLarge, match="20 lines"):
        batch_file_create(tenant_id=tenant.pk, filename="x", purpose="batch", chunks=[b"{}\n" * 21])
    with pytest.raises(storage.FileTooLarge, match="10,000 bytes"):
        batch_file_create(tenant_id=tenant.pk, filename="x", purpose="batch", chunks=[b"x" * 6000, b"y" * 6000])
    assert list(storage.root().iterdir()) == []


def test_an_upload_past_both_limits_is_refused_for_its_size_however_it_is_chunked(tenant):
    # The lines pass their limit in the first chunk, the bytes only in the last: the size is the
    # refusal, as it is when the whole body is seen at once (a declared length over the limit).
    lines = b"{}\n" * 21
    with pytest.raises(storage.FileTooLarge, match="10,000 bytes"):
        batch_file_create(tenant_id=tenant.pk, filename="x", purpose="batch", chunks=[lines, b"x" * 5000, b"y" * 5000])
    assert list(storage.root().iterdir()) == []


def test_an_upload_with_its_purpose_known_only_at_the_end_stores_or_leaves_nothing(tenant):
    upload = batch_file_upload_start(purpose=None)
    upload.write(b'{"a": 1}\n')
    with pytest.raises(BatchRefused, match="purpose"):
        batch_file_upload_finish(upload=upload, tenant_id=tenant.pk, filename="x", purpose="fine-tune")
    assert list(storage.root().iterdir()) == [] and not BatchFile.objects.exists()
    upload = batch_file_upload_start(purpose=None)
    upload.write(b'{"a": 1}\n')
    file = batch_file_upload_finish(upload=upload, tenant_id=tenant.pk, filename="x", purpose="batch")
    assert list(storage.read_chunks(file.storage_name)) == [b'{"a": 1}\n'] and (file.bytes, file.lines) == (9, 1)


@pytest.mark.parametrize(("given", "expected"), [(None, Decimal("0.002")), (Decimal("0.0005"), Decimal("0.0005"))])
def test_the_batch_price_is_the_tiers_or_half_the_interactive_price(given, expected):
    assert batch_price(price_per_request=Decimal("0.004"), batch_price_per_request=given) == expected


def test_nul_characters_in_a_line_and_in_its_answer_are_kept(tenant, model):
    # JSON allows "\u0000" and a tiny random model writes it; PostgreSQL's jsonb refused both, which
    # failed the runner's task on every retry.
    line = {"custom_id": "nul", "method": "POST", "url": "/v1/completions"}
    line["body"] = {"model": "tiny", "prompt": "a\u0000b", "max_tokens": 1}
    file = batch_file_create(
        tenant_id=tenant.pk, filename="in.jsonl", purpose="batch", chunks=[json.dumps(line).encode() + b"\n"]
    )
    batch = batch_create(
        tenant_id=tenant.pk,
        api_key_id=None,
        input_file=file,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        now=timezone.now(),
    )
    batch = batch_validate(batch_id=batch.pk, now=timezone.now())
    [stored] = batch.lines.all()
    assert stored.body["prompt"] == "a\u0000b"
    now = timezone.now()
    assert not isinstance(
        batch_line_hold(
            line=stored, tenant_id=tenant.pk, api_key_id=None, model_id=model.pk, price=Decimal("0.002"), now=now
        ),
        HoldRefused,
    )
    outcome = RequestOutcome(stored.request_id, UsageRecord.Status.COMPLETED, prompt_tokens=2, completion_tokens=1)
    answer = {"object": "text_completion", "choices": [{"text": "\u0000x"}]}
    batch_line_settle(line_id=stored.pk, outcome=outcome, status_code=200, response=answer, error=None, now=now)
    assert BatchLine.objects.get(pk=stored.pk).response == answer


def test_an_id_with_a_nul_character_finds_nothing(tenant):
    # PostgreSQL refuses to compare text with NUL; a client may send one (schemathesis did: a 500).
    from controlplane.batches.selectors import batch_file_get, batch_get, batches_list

    assert batch_file_get(tenant_id=tenant.pk, public_id="file-\x00") is None
    assert batch_get(tenant_id=tenant.pk, public_id="batch_\x00") is None
    assert batches_list(tenant_id=tenant.pk, after="batch_\x00") == []


def _image_batch(tenant, model_name: str, lines: list[list[str]]) -> Batch:
    raw = b"".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model_name,
                    "messages": [
                        {
                            "role": "user",
                            "content": [{"type": "text", "text": "what"}]
                            + [{"type": "image_url", "image_url": {"url": url}} for url in urls],
                        }
                    ],
                    "max_tokens": 1,
                },
            }
        ).encode()
        + b"\n"
        for i, urls in enumerate(lines)
    )
    return _started_batch(tenant, len(lines), raw=raw, endpoint="/v1/chat/completions")


def test_image_lines_beyond_the_catalogs_image_rules_fail_validation_uncharged(tenant, model):
    small = "data:image/png;base64," + "A" * 400
    ModelFactory(public_name="seer", kind="vision", max_images_per_request=1, max_image_bytes=1000)
    failed = _image_batch(tenant, "tiny", [[], [small]])  # tiny is a chat model
    assert failed.status == "failed" and not failed.lines.exists()
    assert [(e["line"], e["param"], e["code"]) for e in failed.errors] == [(2, "body.model", "model_not_multimodal")]
    failed = _image_batch(tenant, "seer", [[small], [small, small], ["data:image/png;base64," + "A" * 2000]])
    assert [(e["line"], e["code"]) for e in failed.errors] == [(2, "too_many_images"), (3, "invalid_image")]
    assert not CreditHold.objects.exists() and not UsageRecord.objects.exists()
    tenant.credit_account.refresh_from_db()
    assert tenant.credit_account.balance == Decimal("1")
    started = _image_batch(tenant, "seer", [[small], []])
    assert (started.status, started.total) == ("in_progress", 2)
