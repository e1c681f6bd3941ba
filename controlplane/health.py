"""Probes: `/healthz` (liveness: the process answers) and `/readyz` (readiness: the database and,
when configured, Redis answer within a short timeout; a 503 names what does not).

Liveness asks nothing of the dependencies, so that an orchestrator does not restart every web
process while the database is down; readiness is what load balancers and start-up waits use.
"""

import asyncio

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_GET

# Each check's limit: a probe must answer well inside its caller's own timeout (docker's is 5 s).
CHECK_TIMEOUT_S = 2.0


@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


@require_GET
async def readyz(request: HttpRequest) -> JsonResponse:
    checks = {"database": _database_answers()}
    if settings.REDIS_URL:
        checks["redis"] = _redis_answers(settings.REDIS_URL)
    results = await asyncio.gather(*(_outcome(check) for check in checks.values()))
    outcome = dict(zip(checks, results))
    down = [name for name, result in outcome.items() if result != "ok"]
    if down:
        # The dependency's name and what happened, never the driver's message (hosts, users).
        message = "Not ready: " + ", ".join(f"{name} {outcome[name]}" for name in down) + "."
        return JsonResponse({"status": "unavailable", "message": message, "checks": outcome}, status=503)
    return JsonResponse({"status": "ready", "checks": outcome})


async def _outcome(check) -> str:
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            await check
    except TimeoutError:
        return "timed out"
    except Exception:
        return "unreachable"
    return "ok"


@sync_to_async(thread_sensitive=False)
def _database_answers() -> None:
    # A thread of its own, so a connection attempt that hangs holds up no other view; its
    # connection is closed again (probes are seconds apart).
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    finally:
        connection.close()


async def _redis_answers(url: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_connect_timeout=CHECK_TIMEOUT_S, socket_timeout=CHECK_TIMEOUT_S)
    try:
        await client.ping()
    finally:
        await client.aclose()
