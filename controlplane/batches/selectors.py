"""The Files and Batch APIs' reads, each scoped to the tenant that owns the rows."""

from controlplane.batches.models import Batch, BatchFile, BatchLine


def _can_exist(public_id) -> bool:
    """Whether a row may have this id: ids are generated text without NUL characters, which a client
    may send and PostgreSQL cannot compare (it refuses the query)."""
    return isinstance(public_id, str) and "\x00" not in public_id


def batch_file_get(*, tenant_id: int, public_id: str) -> BatchFile | None:
    if not _can_exist(public_id):
        return None
    return BatchFile.objects.filter(tenant_id=tenant_id, public_id=public_id, deleted=False).first()


def batch_files_list(*, tenant_id: int, purpose: str | None = None, limit: int = 100) -> list[BatchFile]:
    files = BatchFile.objects.filter(tenant_id=tenant_id, deleted=False)
    if purpose:
        files = files.filter(purpose=purpose)
    return list(files.order_by("-created_at", "-id")[:limit])


def batch_get(*, tenant_id: int, public_id: str) -> Batch | None:
    if not _can_exist(public_id):
        return None
    return (
        Batch.objects.filter(tenant_id=tenant_id, public_id=public_id)
        .select_related("input_file", "output_file", "error_file")
        .first()
    )


def batches_list(*, tenant_id: int, after: str | None = None, limit: int = 20) -> list[Batch]:
    batches = Batch.objects.filter(tenant_id=tenant_id).select_related("input_file", "output_file", "error_file")
    if after and _can_exist(after):
        cursor = Batch.objects.filter(tenant_id=tenant_id, public_id=after).values_list("pk", flat=True).first()
        if cursor is not None:
            batches = batches.filter(pk__lt=cursor)
    return list(batches.order_by("-pk")[:limit])


def batch_lines_pending(*, batch_id: int, limit: int, after: int = 0) -> list[BatchLine]:
    """Pending lines after line number `after`, in order."""
    return list(
        BatchLine.objects.filter(batch_id=batch_id, status=BatchLine.Status.PENDING, line_number__gt=after).order_by(
            "line_number"
        )[:limit]
    )


def batch_status(*, batch_id: int) -> str:
    return Batch.objects.filter(pk=batch_id).values_list("status", flat=True).get()


def batch_model_price(*, model_name: str):
    """(model id, its batch price per request) for the batch's model, or None when the catalog no
    longer has it."""
    from controlplane.billing.pricing import batch_price
    from controlplane.catalog.models import Model

    model = Model.objects.filter(public_name=model_name).select_related("price_tier").first()
    if model is None:
        return None
    tier = model.price_tier
    return model.pk, batch_price(
        price_per_request=tier.price_per_request, batch_price_per_request=tier.batch_price_per_request
    )
