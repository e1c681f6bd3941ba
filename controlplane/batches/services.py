"""The Files and Batch APIs' writes: files stored and deleted, batches created, validated, worked
on under a lease, cancelled, expired and finished with their output and error files. Each line is
settled through billing's holds, in the same transaction that records its answer, so a line is
charged at most once (its usage record's request_id is unique) and never lost between the two."""

import itertools
import json
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F

from controlplane.batches import storage
from controlplane.batches.models import BATCH_ID_PREFIX, Batch, BatchFile, BatchLine, new_public_id
from controlplane.batches.validation import BATCH_ENDPOINTS, COMPLETION_WINDOWS, check_lines, requests_of
from controlplane.billing.holds import (
    HoldRequest,
    RequestOutcome,
    credit_holds_place,
    credit_holds_settle,
)
from controlplane.billing.models import CreditHold
from controlplane.catalog.selectors import model_image_rules
from controlplane.celery import app as celery_app

# Celery task names, sent by name: the runner lives with the gateway's request path.
RUN_TASK = "controlplane.batches.run"
RESUME_TASK = "controlplane.batches.resume"
# Batch work waits behind every other task on the broker (0 is the highest priority).
LOWEST_PRIORITY = 9
_SETTLED = (BatchLine.Status.COMPLETED, BatchLine.Status.FAILED)


class BatchRefused(ValueError):
    """A create or cancel the API refuses: `status` and `param` for its error."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def send_run(batch_id: int) -> None:
    celery_app.send_task(RUN_TASK, args=[batch_id], priority=LOWEST_PRIORITY)


def batch_file_upload_start(*, purpose: str | None) -> storage.ChunkWriter:
    """The writer an upload's bytes go to as they arrive (storage.FileTooLarge past the size or
    line limit). Its purpose is checked now when known, and again at batch_file_upload_finish."""
    if purpose is not None:
        _check_purpose(purpose)
    return storage.ChunkWriter(
        new_public_id("file-"), max_bytes=settings.BATCH_MAX_FILE_BYTES, max_lines=settings.BATCH_MAX_FILE_LINES
    )


def batch_file_upload_finish(*, upload: storage.ChunkWriter, tenant_id: int, filename: str, purpose: str) -> BatchFile:
    """The upload's file in place and its row; on any refusal or failure, neither."""
    try:
        _check_purpose(purpose)
        stored = upload.finish()
        return BatchFile.objects.create(
            public_id=upload.name,
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename[:255] or "upload.jsonl",
            bytes=stored.bytes,
            lines=stored.lines,
            storage_name=stored.name,
        )
    except BaseException:
        upload.discard()
        raise


def batch_file_create(*, tenant_id: int, filename: str, purpose: str, chunks: Iterable[bytes]) -> BatchFile:
    """Store an upload whose bytes come as an iterable (batch_file_upload_start's rules)."""
    upload = batch_file_upload_start(purpose=purpose)
    try:
        for chunk in chunks:
            upload.write(chunk)
    except BaseException:
        upload.discard()
        raise
    return batch_file_upload_finish(upload=upload, tenant_id=tenant_id, filename=filename, purpose=purpose)


def _check_purpose(purpose: str) -> None:
    if purpose != BatchFile.Purpose.BATCH:
        raise BatchRefused('purpose: only "batch" files are accepted.', param="purpose")


def batch_file_delete(*, file: BatchFile) -> None:
    """The file's bytes go; its row stays, marked deleted, as the record of the batches it fed."""
    if file.batches.exclude(status__in=Batch.ENDED).exists():
        raise BatchRefused("This file is the input of a batch still running.", param="file_id", status=409)
    file.deleted = True
    file.save(update_fields=["deleted"])
    name = file.storage_name
    transaction.on_commit(lambda: storage.remove(name))


@transaction.atomic
def batch_create(
    *,
    tenant_id: int,
    api_key_id: int | None,
    input_file: BatchFile,
    endpoint: str,
    completion_window: str,
    metadata: dict | None,
    now: datetime,
) -> Batch:
    if endpoint not in BATCH_ENDPOINTS:
        raise BatchRefused(f"endpoint: must be one of {', '.join(BATCH_ENDPOINTS)}.", param="endpoint")
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchRefused(
            f"completion_window: must be one of {', '.join(COMPLETION_WINDOWS)}.", param="completion_window"
        )
    if input_file.purpose != BatchFile.Purpose.BATCH:
        raise BatchRefused('input_file_id: the file\'s purpose must be "batch".', param="input_file_id")
    window = COMPLETION_WINDOWS[completion_window]
    batch = Batch.objects.create(
        public_id=new_public_id(BATCH_ID_PREFIX),
        tenant_id=tenant_id,
        api_key_id=api_key_id,
        input_file=input_file,
        endpoint=endpoint,
        completion_window_s=window,
        metadata=metadata,
        expires_at=now + timedelta(seconds=window),
    )
    transaction.on_commit(lambda: send_run(batch.pk))
    return batch


def batch_cancel(*, batch: Batch, now: datetime) -> Batch:
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch.pk)
        if batch.status in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
            batch.status, batch.cancelling_at = Batch.Status.CANCELLING, now
            batch.save(update_fields=["status", "cancelling_at"])
            transaction.on_commit(lambda: send_run(batch.pk))
        elif batch.status not in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            raise BatchRefused(f"A batch that is {batch.status} cannot be cancelled.", status=409)
    return batch


def batch_claim(*, batch_id: int, owner: str, now: datetime) -> Batch | None:
    """Take (or renew) the batch's lease for `owner`; None when another runner holds it or the
    batch has ended."""
    until = now + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    taken = (
        Batch.objects.filter(pk=batch_id)
        .exclude(status__in=Batch.ENDED)
        .exclude(lease_until__gt=now, lease_owner__gt="")
        .update(lease_owner=owner, lease_until=until)
    )
    renewed = 0 if taken else Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_until=until)
    return Batch.objects.get(pk=batch_id) if taken or renewed else None


def batch_release(*, batch_id: int, owner: str) -> None:
    Batch.objects.filter(pk=batch_id, lease_owner=owner).update(lease_owner="", lease_until=None)


def batch_validate(*, batch_id: int, now: datetime, schema=None) -> Batch:
    """Check every line (by `schema` where validation.BATCH_ENDPOINTS leaves it to the caller); fail
    the batch with its errors, or record its lines and start it."""
    batch = Batch.objects.select_related("input_file").get(pk=batch_id)
    if batch.status != Batch.Status.VALIDATING:
        return batch
    checked = check_lines(
        storage.read_lines(batch.input_file.storage_name),
        endpoint=batch.endpoint,
        schema=schema,
        image_rules_for=lambda name: model_image_rules(public_name=name),
    )
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status not in (Batch.Status.VALIDATING, Batch.Status.CANCELLING):
            return batch  # another runner validated it meanwhile
        if batch.status == Batch.Status.CANCELLING:
            batch.status, batch.cancelled_at = Batch.Status.CANCELLED, now
        elif checked.errors:
            batch.status, batch.failed_at, batch.errors = Batch.Status.FAILED, now, checked.errors
        else:
            _record_lines(batch)
            batch.status, batch.in_progress_at = Batch.Status.IN_PROGRESS, now
            batch.model_name, batch.total = checked.model, checked.count
        batch.save()
    return batch


def _record_lines(batch: Batch, chunk: int = 2000) -> None:
    """The batch's lines as rows, read from its file in chunks (never the whole file in memory)."""
    requests = requests_of(storage.read_lines(batch.input_file.storage_name))
    while rows := [
        BatchLine(
            batch=batch, line_number=number, custom_id=custom_id, request_id=f"{batch.public_id}:{number}", body=body
        )
        for number, custom_id, body in itertools.islice(requests, chunk)
    ]:
        BatchLine.objects.bulk_create(rows)


def batch_line_hold(*, line: BatchLine, tenant_id: int, api_key_id: int | None, model_id: int, price, now: datetime):
    """The line's credit hold at the batch price (a CreditHold), or billing's HoldRefused. A hold
    left by a runner that died mid-line is released first: its line is sent again."""
    if CreditHold.objects.filter(request_id=line.request_id).exists():
        credit_holds_settle(outcomes=[RequestOutcome(line.request_id, None)], at=now)
    return credit_holds_place(
        requests=[
            HoldRequest(
                request_id=line.request_id,
                tenant_id=tenant_id,
                model_id=model_id,
                api_key_id=api_key_id,
                price_per_request=price,
            )
        ],
        at=now,
        expires_at=now + timedelta(seconds=settings.GATEWAY_REQUEST_TIMEOUT_SECONDS + 60),
    )[0]


def batch_line_settle(
    *,
    line_id: int,
    outcome: RequestOutcome | None,
    status_code: int | None,
    response: dict | None,
    error: dict | None,
    now: datetime,
) -> bool:
    """Record the line's answer (or error) and settle its hold with `outcome`, in one transaction;
    False when the line was settled already (by a runner whose lease ran out), then nothing is
    written and its hold is released."""
    with transaction.atomic():
        line = BatchLine.objects.select_for_update().get(pk=line_id)
        if line.status != BatchLine.Status.PENDING:
            if outcome is not None:
                credit_holds_settle(outcomes=[RequestOutcome(line.request_id, None)], at=now)
            return False
        if outcome is not None:
            credit_holds_settle(outcomes=[outcome], at=now)
        answered = status_code is not None
        line.status = BatchLine.Status.COMPLETED if answered else BatchLine.Status.FAILED
        line.status_code, line.response, line.error = status_code, response, error
        line.save(update_fields=["status", "status_code", "response", "error"])
        ok = status_code == 200
        Batch.objects.filter(pk=line.batch_id).update(
            completed=F("completed") + (1 if ok else 0), failed=F("failed") + (0 if ok else 1)
        )
    return True


def batch_finish(*, batch_id: int, now: datetime) -> Batch:
    """End a batch: cancelled or expired ones fail their unsent lines (not charged); then the
    output and error files are written and the batch is completed (or cancelled, or expired)."""
    batch = Batch.objects.get(pk=batch_id)
    if batch.status in Batch.ENDED:
        return batch
    if batch.status == Batch.Status.VALIDATING:  # expired before it was validated
        return _end(batch, Batch.Status.EXPIRED, now)
    if batch.status == Batch.Status.CANCELLING:
        _fail_pending(batch, "batch_cancelled", "The batch was cancelled before this request was sent.")
        ending = Batch.Status.CANCELLED
    elif now >= batch.expires_at and batch.lines.filter(status=BatchLine.Status.PENDING).exists():
        _fail_pending(batch, "batch_expired", "The batch expired before this request was sent.")
        ending = Batch.Status.EXPIRED
    else:
        if batch.lines.filter(status=BatchLine.Status.PENDING).exists():
            return batch
        ending = Batch.Status.COMPLETED
        if batch.status != Batch.Status.FINALIZING:
            Batch.objects.filter(pk=batch_id).update(status=Batch.Status.FINALIZING, finalizing_at=now)
    batch.refresh_from_db()
    _write_results(batch)
    return _end(batch, ending, now)


def _fail_pending(batch: Batch, code: str, message: str) -> None:
    with transaction.atomic():
        count = batch.lines.filter(status=BatchLine.Status.PENDING).update(
            status=BatchLine.Status.FAILED, error={"code": code, "message": message}
        )
        Batch.objects.filter(pk=batch.pk).update(failed=F("failed") + count)


def _end(batch: Batch, status: str, now: datetime) -> Batch:
    batch.status = status
    setattr(batch, f"{status}_at", now)
    batch.lease_owner, batch.lease_until = "", None
    batch.save()
    return batch


def _write_results(batch: Batch) -> None:
    """The output file (answered with 200) and the error file (the rest), each line with its
    custom_id, in OpenAI's batch output format; a file only when it has lines."""
    lines = batch.lines.order_by("line_number")
    outputs = (_result_line(line) for line in lines.filter(status_code=200).iterator(chunk_size=1000))
    errors = (_result_line(line) for line in lines.exclude(status_code=200).iterator(chunk_size=1000))
    for field, results in (("output_file", outputs), ("error_file", errors)):
        if getattr(batch, field) is not None:
            continue  # written by a finish cut short before
        public_id = new_public_id("file-")
        stored = storage.store_lines(public_id, results)
        if stored.lines:
            produced = BatchFile.objects.create(
                public_id=public_id,
                tenant_id=batch.tenant_id,
                purpose=BatchFile.Purpose.BATCH_OUTPUT,
                filename=f"{batch.public_id}_{'output' if field == 'output_file' else 'error'}.jsonl",
                bytes=stored.bytes,
                lines=stored.lines,
                storage_name=stored.name,
            )
            setattr(batch, field, produced)
        else:
            storage.remove(stored.name)
    batch.save(update_fields=["output_file", "error_file"])


def _result_line(line: BatchLine) -> bytes:
    response = None
    if line.status_code is not None:
        response = {"status_code": line.status_code, "request_id": line.request_id, "body": line.response}
    return json.dumps(
        {
            "id": f"batch_req_{line.request_id.replace(':', '_')}",
            "custom_id": line.custom_id,
            "response": response,
            "error": line.error,
        }
    ).encode()


def batches_resume(*, now: datetime) -> list[int]:
    """Batches that need a runner (not ended, no live lease): each is sent to one. A runner that
    died (its worker killed, the machine restarted) leaves its lease to run out, and its batch is
    picked up here where its lines' rows say it stopped."""
    ids = list(
        Batch.objects.exclude(status__in=Batch.ENDED).exclude(lease_until__gt=now).values_list("pk", flat=True)[:1000]
    )
    for batch_id in ids:
        send_run(batch_id)
    return ids
