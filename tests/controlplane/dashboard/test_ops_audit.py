"""The audit log page: who did what to which target and when, filtered and paginated."""

import pytest
from django.urls import reverse

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.dashboard.ops.views import AUDIT_PAGE_SIZE
from tests.controlplane.dashboard.ops_support import _private_live_cache  # noqa: F401 (fixture)
from tests.controlplane.factories import ModelFactory, UserFactory

pytestmark = pytest.mark.django_db


def test_the_log_shows_who_what_when_and_the_target(operator_client):
    olga = UserFactory(username="olga")
    model = ModelFactory(public_name="llama-8b")
    entry = audit_record(
        actor=olga, action=AuditEntry.Action.MODEL_UPDATE, target=model, detail={"context_length": [4096, 8192]}
    )
    page = operator_client.get(reverse("dashboard:audit")).content.decode()
    row = page[page.index('data-testid="audit-row"') :]
    row = row[: row.index("</tr>")]
    assert "olga" in row and "Model edited" in row and "llama-8b" in row
    assert f"(catalog.model {model.pk})" in row and "context_length: 4096 → 8192" in row
    assert entry.created_at.strftime("%Y-%m-%d %H:%M:%S") in row


def test_filters_by_action_and_actor_and_htmx_gets_the_table_only(operator_client):
    alice, bob = UserFactory(username="alice"), UserFactory(username="bob")
    model = ModelFactory()
    audit_record(actor=alice, action=AuditEntry.Action.MODEL_DISABLE, target=model)
    audit_record(actor=bob, action=AuditEntry.Action.MODEL_ENABLE, target=model)
    audit_record(actor=alice, action=AuditEntry.Action.MODEL_ENABLE, target=model)
    url = reverse("dashboard:audit")
    page = operator_client.get(url, {"action": "model.enable"}).content.decode()
    assert page.count('data-testid="audit-row"') == 2
    fragment = operator_client.get(
        url, {"action": "model.enable", "actor": "alice"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert fragment.lstrip().startswith('<div id="audit-table"') and "<html" not in fragment
    assert fragment.count('data-testid="audit-row"') == 1
    nothing = operator_client.get(url, {"actor": "carol"}).content.decode()  # not a known actor: ignored filter
    assert nothing.count('data-testid="audit-row"') == 3
    empty = operator_client.get(url, {"action": "worker.drain"}).content.decode()
    assert "No entries match these filters." in empty


def test_the_log_is_paginated_newest_first(operator_client):
    model = ModelFactory()
    AuditEntry.objects.bulk_create(
        [
            AuditEntry(
                actor_label=f"user{i:03d}",
                action="model.update",
                target_type="catalog.model",
                target_id=str(model.pk),
                target_label="m",
            )
            for i in range(AUDIT_PAGE_SIZE + 5)
        ]
    )
    url = reverse("dashboard:audit")
    first = operator_client.get(url).content.decode()
    assert first.count('data-testid="audit-row"') == AUDIT_PAGE_SIZE
    assert "Page 1 of 2" in first and "page=2" in first
    second = operator_client.get(url, {"page": 2, "action": "model.update"}).content.decode()
    assert second.count('data-testid="audit-row"') == 5
    assert "action=model.update&amp;page=1" in second  # the filter survives paging


def test_empty_log(operator_client):
    assert "Nothing recorded yet" in operator_client.get(reverse("dashboard:audit")).content.decode()
