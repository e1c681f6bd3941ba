"""The OpenAI Files and Batch APIs: /v1/files and /v1/batches. Key checks as on every /v1 route;
the work (files to storage, rows) runs in controlplane.batches' services on the gateway's files
lane, off the event loop. A batch's lines run later, in Celery (batch_lines)."""

import json

from django.conf import settings
from django.utils import timezone
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from controlplane.batches import storage
from controlplane.batches.models import Batch, BatchFile
from controlplane.batches.selectors import batch_file_get, batch_files_list, batch_get, batches_list
from controlplane.batches.services import (
    BatchRefused,
    batch_cancel,
    batch_create,
    batch_file_delete,
    batch_file_upload_finish,
    batch_file_upload_start,
)
from controlplane.batches.validation import BATCH_ENDPOINTS
from controlplane.gateway.errors import GatewayError, bad_request, model_not_allowed, model_not_found
from controlplane.gateway.multipart_upload import MultipartRefused, UploadForm
from controlplane.gateway.process import Gateway
from controlplane.gateway.request_body import bounded

# A multipart upload's envelope (boundaries, the part's headers, the purpose field) on top of the file.
_MULTIPART_SLACK_BYTES = 64 * 1024
# The form's fields other than the file (its purpose).
_FIELD_BYTES = 1024


def file_json(file: BatchFile) -> dict:
    return {
        "id": file.public_id,
        "object": "file",
        "bytes": file.bytes,
        "created_at": int(file.created_at.timestamp()),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": "processed",
    }


def _ts(moment) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def batch_json(batch: Batch) -> dict:
    return {
        "id": batch.public_id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model_name or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file.public_id,
        "completion_window": "24h",
        "status": batch.status,
        "output_file_id": batch.output_file.public_id if batch.output_file else None,
        "error_file_id": batch.error_file.public_id if batch.error_file else None,
        "created_at": _ts(batch.created_at),
        **{
            f"{moment}_at": _ts(getattr(batch, f"{moment}_at"))
            for moment in (
                "in_progress",
                "expires",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
            )
        },
        "request_counts": {"total": batch.total, "completed": batch.completed, "failed": batch.failed},
        "metadata": batch.metadata,
    }


def _refused(error: BatchRefused) -> GatewayError:
    return GatewayError(error.status, error.message, param=error.param, code=error.code)


def _not_found(what: str, public_id: str, param: str) -> GatewayError:
    return GatewayError(404, f"No {what} with id {public_id!r}.", param=param, code="not_found")


def _file_refused(error: storage.FileTooLarge) -> GatewayError:
    # Past the size limit the rest of the body is not read, so the connection cannot carry another request.
    if error.field == "bytes":
        return GatewayError(413, str(error), param="file", code="file_too_large", headers={"connection": "close"})
    return GatewayError(400, str(error), param="file", code="file_too_large")


async def files_create(gw: Gateway, request: Request, request_id: str) -> Response:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    limit = settings.BATCH_MAX_FILE_BYTES
    # Refused from its Content-Length, or for a chunked upload as soon as the bytes received pass
    # the limit, the rest never read.
    upload_body = bounded(request, limit + _MULTIPART_SLACK_BYTES, lambda: _file_refused(storage.too_many_bytes(limit)))
    try:
        form = UploadForm(
            request.headers.get("content-type", ""), file_field="file", max_fields=4, max_field_bytes=_FIELD_BYTES
        )
    except MultipartRefused as exc:
        raise _not_multipart(exc) from None
    try:
        file = await _store_upload(gw, upload_body, form, tenant_id=grant.tenant_id)
    except storage.FileTooLarge as exc:
        raise _file_refused(exc) from None
    except BatchRefused as exc:
        raise _refused(exc) from None
    return JSONResponse(file_json(file), headers={"x-request-id": request_id})


def _not_multipart(error: Exception) -> GatewayError:
    return bad_request(f"Send the file as multipart/form-data with fields file and purpose ({error}).")


async def _store_upload(gw: Gateway, body: Request, form: UploadForm, *, tenant_id: int) -> BatchFile:
    """The file part written to storage as it is parsed, through the writer that bounds its bytes
    and lines; the purpose, before or after it, is checked as soon as both are known. Whatever
    fails (the client gone, a limit, a bad form) leaves no file and no row."""
    upload: storage.ChunkWriter | None = None
    try:
        try:
            async for chunk in body.stream():
                form.feed(chunk)
                if upload is None and form.filename is not None:  # the purpose, if it came first, is checked now
                    known = form.fields.get("purpose") or None
                    upload = await gw.files_lane.run(batch_file_upload_start, purpose=known)
                if upload is not None and (data := form.take_file_data()):
                    await gw.files_lane.run(upload.write, data)
            form.finish()
        except (MultipartRefused, ClientDisconnect) as exc:
            raise _not_multipart(exc) from None
        if upload is None or form.filename is None:
            raise bad_request("file: attach the JSONL file to upload.", param="file")
        purpose = form.fields.get("purpose")
        if not purpose:
            raise bad_request('purpose: give the file\'s purpose ("batch").', param="purpose")
        return await gw.files_lane.run(
            batch_file_upload_finish, upload=upload, tenant_id=tenant_id, filename=form.filename, purpose=purpose
        )
    except BaseException:
        if upload is not None:
            await gw.files_lane.run(upload.discard)
        raise


async def files_list(gw: Gateway, request: Request, request_id: str) -> Response:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    files = await gw.files_lane.run(
        batch_files_list, tenant_id=grant.tenant_id, purpose=request.query_params.get("purpose")
    )
    return JSONResponse(
        {"object": "list", "data": [file_json(f) for f in files], "has_more": False},
        headers={"x-request-id": request_id},
    )


async def _file(gw: Gateway, request: Request) -> BatchFile:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    public_id = request.path_params["file_id"]
    file = await gw.files_lane.run(batch_file_get, tenant_id=grant.tenant_id, public_id=public_id)
    if file is None:
        raise _not_found("file", public_id, "file_id")
    return file


async def file_retrieve(gw: Gateway, request: Request, request_id: str) -> Response:
    return JSONResponse(file_json(await _file(gw, request)), headers={"x-request-id": request_id})


async def file_delete(gw: Gateway, request: Request, request_id: str) -> Response:
    file = await _file(gw, request)
    try:
        await gw.files_lane.run(batch_file_delete, file=file)
    except BatchRefused as exc:
        raise _refused(exc) from None
    return JSONResponse({"id": file.public_id, "object": "file", "deleted": True}, headers={"x-request-id": request_id})


async def file_content(gw: Gateway, request: Request, request_id: str) -> Response:
    file = await _file(gw, request)
    if not storage.path_of(file.storage_name).exists():
        raise GatewayError(404, "This file's content was deleted.", param="file_id", code="not_found")
    return StreamingResponse(
        storage.read_chunks(file.storage_name),  # Starlette iterates a plain iterator in a thread
        media_type="application/jsonl",
        headers={"x-request-id": request_id},
    )


async def batches_create(gw: Gateway, request: Request, request_id: str) -> Response:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    try:
        body = json.loads(await request.body())
    except ValueError:
        raise bad_request("The body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The body must be a JSON object.")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in BATCH_ENDPOINTS:
        raise bad_request(f"endpoint: must be one of {', '.join(BATCH_ENDPOINTS)}.", param="endpoint")
    window = body.get("completion_window")
    if not isinstance(window, str):
        raise bad_request('completion_window: must be "24h".', param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and (
        not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_request("metadata: at most 16 string values.", param="metadata")
    file_id = body.get("input_file_id")
    file = None
    if isinstance(file_id, str):
        file = await gw.files_lane.run(batch_file_get, tenant_id=grant.tenant_id, public_id=file_id)
    if file is None:
        raise _not_found("file", str(file_id), "input_file_id")
    await _check_model(gw, grant, file, endpoint)
    try:
        batch = await gw.files_lane.run(
            batch_create,
            tenant_id=grant.tenant_id,
            api_key_id=grant.key_id,
            input_file=file,
            endpoint=endpoint,
            completion_window=window,
            metadata=metadata,
            now=timezone.now(),
        )
    except BatchRefused as exc:
        raise _refused(exc) from None
    batch.input_file = file
    return JSONResponse(batch_json(batch), headers={"x-request-id": request_id})


async def _check_model(gw: Gateway, grant, file: BatchFile, endpoint: str) -> None:
    """The model the file's first request names exists, the key may use it, and it serves the
    endpoint; every line is checked in full (the same model on each) when the batch is validated."""

    def first_model():
        for raw in storage.read_lines(file.storage_name):
            if raw.strip():
                try:
                    return ((json.loads(raw) or {}).get("body") or {}).get("model")
                except (ValueError, AttributeError):
                    return None
        return None

    name = await gw.files_lane.run(first_model)
    if not isinstance(name, str):
        return  # validation names the line
    model = await gw.routing.model(name)
    if model is None:
        raise model_not_found(name)
    if not grant.allows(model.model_id):
        raise model_not_allowed(name)
    if (model.kind == "embedding") != (endpoint == "/v1/embeddings"):
        raise bad_request(f"{name!r} does not serve {endpoint}.", param="endpoint", code="wrong_model_kind")


async def _batch(gw: Gateway, request: Request) -> Batch:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    public_id = request.path_params["batch_id"]
    batch = await gw.files_lane.run(batch_get, tenant_id=grant.tenant_id, public_id=public_id)
    if batch is None:
        raise _not_found("batch", public_id, "batch_id")
    return batch


async def batch_retrieve(gw: Gateway, request: Request, request_id: str) -> Response:
    return JSONResponse(batch_json(await _batch(gw, request)), headers={"x-request-id": request_id})


async def batch_cancel_view(gw: Gateway, request: Request, request_id: str) -> Response:
    batch = await _batch(gw, request)
    try:
        await gw.files_lane.run(batch_cancel, batch=batch, now=timezone.now())
    except BatchRefused as exc:
        raise _refused(exc) from None
    batch = await gw.files_lane.run(batch_get, tenant_id=batch.tenant_id, public_id=batch.public_id)
    return JSONResponse(batch_json(batch), headers={"x-request-id": request_id})


async def batches_list_view(gw: Gateway, request: Request, request_id: str) -> Response:
    grant = await gw.keys.request_grant(request, request.headers.get("authorization"))
    try:
        limit = min(100, max(1, int(request.query_params.get("limit", "20"))))
    except ValueError:
        raise bad_request("limit: give a whole number from 1 to 100.", param="limit") from None
    batches = await gw.files_lane.run(
        batches_list, tenant_id=grant.tenant_id, after=request.query_params.get("after"), limit=limit + 1
    )
    data = [batch_json(b) for b in batches[:limit]]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(batches) > limit,
        },
        headers={"x-request-id": request_id},
    )


ROUTES = (
    ("/v1/files", files_create, ["POST"]),
    ("/v1/files", files_list, ["GET"]),
    ("/v1/files/{file_id}", file_retrieve, ["GET"]),
    ("/v1/files/{file_id}", file_delete, ["DELETE"]),
    ("/v1/files/{file_id}/content", file_content, ["GET"]),
    ("/v1/batches", batches_create, ["POST"]),
    ("/v1/batches", batches_list_view, ["GET"]),
    ("/v1/batches/{batch_id}", batch_retrieve, ["GET"]),
    ("/v1/batches/{batch_id}/cancel", batch_cancel_view, ["POST"]),
)
