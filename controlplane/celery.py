"""The Celery application: configured from Django settings (CELERY_*), tasks found per app."""

import os

from celery import Celery
from celery.signals import after_setup_logger

from controlplane.routine_logs import quiet_celery_task_lines
from gpuworker.contract import sqlite_broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# The embedded set-up's broker URL (sqlite://, settings.CELERY_BROKER_URL) names this transport.
sqlite_broker.register()

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@after_setup_logger.connect
def _quiet_task_lines(loglevel=None, **kwargs) -> None:
    # Beat sends the lost-worker check every second; its "received"/"succeeded" lines would fill the log.
    quiet_celery_task_lines(loglevel)
