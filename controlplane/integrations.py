"""Settings for the services the control plane talks to: the database, Redis, the Celery broker.

Each function returns the PostgreSQL/Redis configuration when its URL is given and otherwise an
embedded stand-in that needs no server (SQLite, locmem cache, in-memory channel layer, a Celery
broker in a SQLite file), which is what `make run` uses.
"""

from pathlib import Path
from typing import Any

import dj_database_url

from gpuworker.contract import sqlite_broker


def database(database_url: str, var_dir: Path) -> dict[str, Any]:
    if database_url:
        config = dj_database_url.parse(database_url, conn_max_age=60, conn_health_checks=True)
    else:
        var_dir.mkdir(parents=True, exist_ok=True)
        config = dj_database_url.parse(f"sqlite:///{var_dir / 'db.sqlite3'}")
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # The web server, Celery worker and beat share one file: wait for the write lock instead
        # of failing, and take it at BEGIN so two writers never deadlock upgrading read locks.
        config["OPTIONS"] = {"timeout": 20, "transaction_mode": "IMMEDIATE", **config.get("OPTIONS", {})}
    return config


def caches(redis_url: str) -> dict[str, Any]:
    if redis_url:
        return {
            "default": {
                "BACKEND": "django.core.cache.backends.redis.RedisCache",
                "LOCATION": redis_url,
                "KEY_PREFIX": "gpuserve",
            }
        }
    return {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}


def channel_layers(redis_url: str, relay_port: int = 0) -> dict[str, Any]:
    if redis_url:
        return {
            "default": {
                "BACKEND": "channels_redis.core.RedisChannelLayer",
                # No client-side read timeout: the layer's receive is a blocking pop that waits
                # for its own server-side timeout, and redis-py 8 otherwise cuts every idle read
                # at 5 s, tearing down idle WebSocket consumers (django/channels_redis#422).
                "CONFIG": {"hosts": [{"address": redis_url, "socket_timeout": None}], "prefix": "gpuserve"},
            }
        }
    # One web process in the embedded set-up, so an in-process layer reaches every consumer; the
    # other processes relay their events to it (controlplane.live_relay).
    return {
        "default": {
            "BACKEND": "controlplane.live_relay.RelayedInMemoryChannelLayer",
            "CONFIG": {"relay_port": relay_port},
        }
    }


def celery_broker(redis_url: str, var_dir: Path) -> tuple[str, dict[str, Any]]:
    """The broker URL and its transport options."""
    if redis_url:
        return redis_url, {}
    # Several processes send and take at once (web, Celery worker and beat, the GPU worker daemon):
    # SQLite's transactions keep every message whole (gpuworker.contract.sqlite_broker).
    broker_dir = var_dir / "celery"
    broker_dir.mkdir(parents=True, exist_ok=True)
    return sqlite_broker.broker_url(broker_dir / "broker.sqlite3"), {}


def celery_result_backend(redis_url: str) -> str | None:
    """Redis, or no result backend: nothing in the system reads a task's result (the embedded
    set-up's file:// backend wrote one file per task, truncated then filled, unread)."""
    return redis_url or None


def unreachable_dependency(exc: BaseException) -> str | None:
    """ "database" or "redis" when `exc` says that service cannot be reached right now (an answer
    to give as a 503, naming it), None for any other error."""
    import redis.exceptions
    from django.db import InterfaceError, OperationalError

    if isinstance(exc, (OperationalError, InterfaceError)):
        return "database"
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return "redis"
    return None
