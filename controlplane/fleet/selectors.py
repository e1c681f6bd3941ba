"""Reads for the fleet."""

from django.db.models import QuerySet

from controlplane.fleet.models import Replica, Worker
from controlplane.tokens import secret_hash


def worker_get_by_token(*, token: str) -> Worker | None:
    return Worker.objects.filter(token_hash=secret_hash(token)).first()


def replicas_ready_for_model(*, model) -> QuerySet[Replica]:
    """Replicas that can take requests for `model` right now, on workers that are online."""
    return Replica.objects.filter(
        deployment__model=model, state=Replica.State.READY, worker__state=Worker.State.ONLINE
    ).select_related("worker", "gpu")
