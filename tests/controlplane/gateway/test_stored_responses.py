"""The Responses API's store: scoped to the tenant, read as gone once past the retention, and
swept by the periodic task."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.gateway.models import StoredResponse
from controlplane.gateway.stored_responses import (
    stored_response_delete,
    stored_response_get,
    stored_response_save,
)
from controlplane.gateway.tasks import sweep_stored_responses
from tests.controlplane.factories import TenantFactory

pytestmark = pytest.mark.django_db


def _save(tenant, response_id: str, text: str = "hi", status: str = "completed") -> StoredResponse:
    item = {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return stored_response_save(
        tenant_id=tenant.pk,
        response_id=response_id,
        input_items=[item],
        history=[item],
        response={"id": response_id, "status": status},
        background=status != "completed",
    )


def test_a_response_is_its_tenants_alone():
    mine, theirs = TenantFactory(), TenantFactory()
    _save(mine, "resp_a", text="nul \x00 and all")  # model output may hold NUL characters
    stored = stored_response_get(tenant_id=mine.pk, response_id="resp_a")
    assert (
        stored.response == {"id": "resp_a", "status": "completed"}
        and stored.input_items[0]["content"][0]["text"] == "nul \x00 and all"
    )
    assert stored_response_get(tenant_id=theirs.pk, response_id="resp_a") is None
    assert not stored_response_delete(tenant_id=theirs.pk, response_id="resp_a")
    assert stored_response_get(tenant_id=mine.pk, response_id="resp a\x00") is None  # not an id: not looked up
    assert stored_response_delete(tenant_id=mine.pk, response_id="resp_a")
    assert stored_response_get(tenant_id=mine.pk, response_id="resp_a") is None


def test_retention_hides_then_the_sweep_deletes_old_responses(settings):
    settings.GATEWAY_RESPONSES_RETENTION_DAYS = 7
    tenant = TenantFactory()
    _save(tenant, "resp_old")
    _save(tenant, "resp_new")
    StoredResponse.objects.filter(id="resp_old").update(created_at=timezone.now() - timedelta(days=8))
    assert stored_response_get(tenant_id=tenant.pk, response_id="resp_old") is None  # past it, even unswept
    assert sweep_stored_responses() == 1
    assert list(StoredResponse.objects.values_list("id", flat=True)) == ["resp_new"]


def test_beat_runs_the_sweep(settings):
    entry = settings.CELERY_BEAT_SCHEDULE["gateway-sweep-stored-responses"]
    assert entry["task"] == sweep_stored_responses.name


def test_the_sweep_fails_background_responses_whose_process_stopped():
    tenant = TenantFactory()
    _save(tenant, "resp_lost", status="queued")
    _save(tenant, "resp_running", status="in_progress")
    StoredResponse.objects.filter(id="resp_lost").update(created_at=timezone.now() - timedelta(days=1))
    sweep_stored_responses()
    lost = stored_response_get(tenant_id=tenant.pk, response_id="resp_lost")
    assert lost.status == "failed" and lost.response["error"]["code"] == "server_error"
    assert stored_response_get(tenant_id=tenant.pk, response_id="resp_running").status == "in_progress"
