"""The Responses API's store: scoped to the tenant, read as gone once past the retention, and
swept by the periodic task; a background response's claim, renewed by its process and taken over
by exactly one other once it runs out."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.gateway.models import StoredResponse
from controlplane.gateway.stored_responses import (
    BackgroundRun,
    stored_response_delete,
    stored_response_finish,
    stored_response_get,
    stored_response_running,
    stored_response_save,
    stored_responses_claim,
    stored_responses_renew,
)
from controlplane.gateway.tasks import sweep_stored_responses
from tests.controlplane.factories import ApiKeyFactory, TenantFactory

pytestmark = pytest.mark.django_db


def _save(tenant, response_id: str, text: str = "hi", status: str = "completed", owner: str = "") -> StoredResponse:
    item = {"type": "message", "id": "msg_1", "role": "user", "content": [{"type": "input_text", "text": text}]}
    run = None
    if owner:
        key = ApiKeyFactory(tenant=tenant)
        run = BackgroundRun(request='{"input": "hi"}', api_key_id=key.pk, request_id=f"req_{response_id}", owner=owner)
    return stored_response_save(
        tenant_id=tenant.pk,
        response_id=response_id,
        input_items=[item],
        history=[item],
        response={"id": response_id, "status": status},
        background=run,
    )


def _expire(response_id: str) -> None:
    StoredResponse.objects.filter(id=response_id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


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


def test_the_sweep_fails_background_responses_nobody_took_over():
    tenant = TenantFactory()
    _save(tenant, "resp_lost", status="queued", owner="dead")
    _save(tenant, "resp_running", status="in_progress", owner="alive")
    _save(tenant, "resp_old_live", status="in_progress", owner="alive")
    an_hour_ago = timezone.now() - timedelta(hours=1)
    StoredResponse.objects.filter(id="resp_lost").update(lease_expires_at=an_hour_ago)
    # Running for an hour (taken over, say) but its claim renewed: not lost.
    StoredResponse.objects.filter(id="resp_old_live").update(created_at=an_hour_ago)
    sweep_stored_responses()
    lost = stored_response_get(tenant_id=tenant.pk, response_id="resp_lost")
    assert lost.status == "failed" and lost.response["error"]["code"] == "server_error"
    assert stored_response_get(tenant_id=tenant.pk, response_id="resp_running").status == "in_progress"
    assert stored_response_get(tenant_id=tenant.pk, response_id="resp_old_live").status == "in_progress"


def test_a_claim_is_renewed_by_its_owner_and_taken_over_once_it_runs_out():
    tenant = TenantFactory()
    _save(tenant, "resp_mine", status="queued", owner="alive")
    _save(tenant, "resp_orphan", status="in_progress", owner="dead")
    _expire("resp_orphan")
    _expire("resp_mine")
    assert stored_responses_renew(owner="alive", now=timezone.now()) == 1  # its process still runs it
    (claimed,) = stored_responses_claim(owner="rescuer", now=timezone.now())
    assert (claimed.id, claimed.lease_owner, claimed.runs, claimed.request_id) == (
        "resp_orphan",
        "rescuer",
        2,
        "req_resp_orphan",
    )
    assert stored_responses_claim(owner="another", now=timezone.now()) == []  # the new claim holds
    # The dead process's run, should it come back, sees it is no longer its own and stores nothing.
    assert not stored_response_running(response_id="resp_orphan", owner="dead")
    assert stored_response_running(response_id="resp_orphan", owner="rescuer")
    late = {"id": "resp_orphan", "status": "completed"}
    assert not stored_response_finish(
        tenant_id=tenant.pk, response_id="resp_orphan", history=[], response=late, owner="dead"
    )
    assert stored_response_finish(
        tenant_id=tenant.pk, response_id="resp_orphan", history=[], response=late, owner="rescuer"
    )


def test_a_response_run_too_often_is_failed_not_run_again(settings):
    settings.GATEWAY_BACKGROUND_RUNS = 2
    tenant = TenantFactory()
    _save(tenant, "resp_unlucky", status="queued", owner="first")
    _expire("resp_unlucky")
    assert [s.id for s in stored_responses_claim(owner="second", now=timezone.now())] == ["resp_unlucky"]
    _expire("resp_unlucky")
    assert stored_responses_claim(owner="third", now=timezone.now()) == []
    failed = stored_response_get(tenant_id=tenant.pk, response_id="resp_unlucky")
    assert failed.status == "failed" and "interrupted 2 time(s)" in failed.response["error"]["message"]


@pytest.mark.django_db(transaction=True)
def test_processes_racing_for_an_orphan_claim_it_once():
    if connection.vendor != "postgresql":
        pytest.skip("row locks are PostgreSQL's")
    tenant = TenantFactory()
    for index in range(5):
        _save(tenant, f"resp_orphan{index}", status="queued", owner="dead")
        _expire(f"resp_orphan{index}")
    start, claims = threading.Barrier(4), {}

    def claim(owner: str) -> None:
        try:
            start.wait()
            claims[owner] = [s.id for s in stored_responses_claim(owner=owner, now=timezone.now(), limit=2)]
            claims[owner] += [s.id for s in stored_responses_claim(owner=owner, now=timezone.now(), limit=2)]
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(f"process{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    taken = [response_id for ids in claims.values() for response_id in ids]
    assert sorted(taken) == [f"resp_orphan{index}" for index in range(5)]  # each once, none twice
    assert set(StoredResponse.objects.values_list("runs", flat=True)) == {2}
