"""The control plane: a Django project whose apps live in this package."""

# Loading the Celery app with Django makes `shared_task` bind to it and `celery -A controlplane` work.
from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
