"""A saved or deleted plan is recorded for the gateways' key caches, as key and tenant changes are;
a new plan is not (nothing can have cached it)."""

import pytest

from controlplane.accounts.models import ApiKeyChange
from tests.controlplane.factories import PlanFactory

pytestmark = pytest.mark.django_db


def test_a_changed_or_deleted_plan_is_recorded_and_a_new_one_is_not():
    plan = PlanFactory()
    assert not ApiKeyChange.objects.filter(plan_id=plan.pk).exists()

    plan.rate_limit_per_minute = 5
    plan.save()
    assert ApiKeyChange.objects.filter(plan_id=plan.pk).count() == 1

    plan_id = plan.pk
    plan.delete()
    assert ApiKeyChange.objects.filter(plan_id=plan_id).count() == 2
