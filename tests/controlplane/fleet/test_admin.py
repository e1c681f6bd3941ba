"""Quality measurements in the admin: listed with where they ran and how they ended, read-only
(the catalog asks for them and their workers' reports move them on)."""

from datetime import timedelta

import pytest
from django.contrib import admin
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.fleet.models import QualityMeasurement
from tests.controlplane.factories import ModelFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def test_measurements_cannot_be_added_edited_or_deleted_in_the_admin():
    model_admin = admin.site._registry[QualityMeasurement]
    request = RequestFactory().get("/admin/")
    assert isinstance(model_admin, ReadOnlyAdmin)
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request) and not model_admin.has_delete_permission(request)


def test_the_list_shows_model_worker_device_state_and_how_each_ended(admin_client):
    worker = WorkerFactory(name="gpu-a")
    ended = timezone.now() - timedelta(minutes=5)
    QualityMeasurement.objects.create(
        model=ModelFactory(public_name="smol"), worker=worker, gpu_index=1, state="done", state_changed_at=ended
    )
    failed = QualityMeasurement.objects.create(
        model=ModelFactory(public_name="big"), worker=worker, state="failed", error="out of memory on the CPU"
    )
    running = QualityMeasurement.objects.create(model=ModelFactory(public_name="new"), worker=worker, state="running")
    model_admin = admin.site._registry[QualityMeasurement]
    rows = [
        (m.model.public_name, model_admin.device(m), m.state, model_admin.finished(m), model_admin.reason(m))
        for m in QualityMeasurement.objects.order_by("pk")
    ]
    assert rows == [
        ("smol", "GPU 1", "done", ended, ""),
        ("big", "CPU", "failed", failed.state_changed_at, "out of memory on the CPU"),
        ("new", "CPU", "running", None, ""),
    ]
    page = admin_client.get(reverse("admin:fleet_qualitymeasurement_changelist")).content.decode()
    for text in ("smol", "gpu-a", "GPU 1", "Done", "out of memory on the CPU", "Running"):
        assert text in page
    # Opened, it is shown but offers no save.
    detail = admin_client.get(reverse("admin:fleet_qualitymeasurement_change", args=[running.pk])).content.decode()
    assert "new" in detail and 'name="_save"' not in detail
