"""Where /v1 bodies are parsed: small ones on the event loop (microseconds), large ones in a pool
of worker processes, at most a few of one tenant's at a time.

Parsing is CPU work that holds the GIL: json.loads and pydantic over megabytes of token ids keep
it for the whole call, so a thread would stall the event loop (and every stream and limit check
on it) as surely as parsing on the loop itself. A worker process gets the
bytes and gives back a small `body_check.CheckedBody`; the body's ids are never sent back.

The pool is shared by every tenant of this process; a tenant's large bodies beyond
GATEWAY_BODY_PARSERS_PER_TENANT wait for their turn (they were admitted against the key's and the
tenant's concurrency limits before, so the wait is bounded), and others' are parsed meanwhile.
The bound is per tenant, not per key: a tenant can create keys, not tenants.

Parsers are spawned processes: like any, they import the server's main module, which must be safe
to import (uvicorn's and gunicorn's are; a script of one's own needs `if __name__ == "__main__"`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from pydantic import BaseModel

from controlplane.gateway.body_check import CheckedBody, ModelLimits, check_body
from controlplane.gateway.errors import unavailable
from controlplane.gateway.parser_process import start_parser

logger = logging.getLogger(__name__)


class _TenantTurns:
    """A tenant's slots in the pool, and how many of its bodies hold or wait for one."""

    def __init__(self, slots: int):
        self.semaphore = asyncio.Semaphore(slots)
        self.users = 0  # bodies in the pool or waiting for a turn
        self.parsing = 0


class BodyParsers:
    def __init__(self, *, workers: int, per_tenant: int, inline_bytes: int, retry_after_s: int):
        self.inline_bytes = inline_bytes
        self._workers, self._per_tenant, self._retry_after_s = workers, per_tenant, retry_after_s
        self._pool: ProcessPoolExecutor | None = None
        self._turns: dict[int, _TenantTurns] = {}

    def parses_inline(self, raw: bytes) -> bool:
        return len(raw) <= self.inline_bytes

    def tenant_load(self, tenant_id: int) -> tuple[int, int]:
        """How many of the tenant's large bodies are in the pool now, and how many wait for a turn."""
        turns = self._turns.get(tenant_id)
        return (turns.parsing, turns.users - turns.parsing) if turns is not None else (0, 0)

    async def check(
        self,
        tenant_id: int,
        raw: bytes,
        schema: type[BaseModel],
        affinity_chars: int,
        model_limits: dict[str, ModelLimits],
    ) -> CheckedBody:
        """`body_check.check_body` of `raw`: here if it is small, else in the pool in the tenant's turn."""
        if self.parses_inline(raw):
            return check_body(raw, schema, affinity_chars, model_limits)
        turns = self._turns.get(tenant_id)
        if turns is None:
            turns = self._turns[tenant_id] = _TenantTurns(self._per_tenant)
        turns.users += 1
        try:
            async with turns.semaphore:
                turns.parsing += 1
                try:
                    return await self._in_pool(raw, schema, affinity_chars, model_limits)
                finally:
                    turns.parsing -= 1
        finally:
            turns.users -= 1
            if not turns.users:
                del self._turns[tenant_id]

    async def _in_pool(
        self, raw: bytes, schema: type[BaseModel], affinity_chars: int, model_limits: dict[str, ModelLimits]
    ) -> CheckedBody:
        pool = self._pool_now()
        try:
            work = asyncio.get_running_loop().run_in_executor(
                pool, check_body, raw, schema, affinity_chars, model_limits
            )
        except BrokenProcessPool:
            work = None
        if work is not None:
            try:
                # A client that leaves does not end the work: the tenant's turn lasts until its
                # body is parsed, so leaving and sending again cannot take more of the pool.
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                await asyncio.wait({work})
                raise
            except BrokenProcessPool:
                pass
        # A worker died (killed for memory, say): the pool cannot be used any more. A new one
        # serves the next requests; this one is answered as retryable.
        logger.error("a request body parser process died; starting a new pool")
        self._replace(pool)
        raise unavailable(
            "The request could not be parsed right now; try again.", self._retry_after_s, code="parser_unavailable"
        )

    def _pool_now(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Spawned, not forked: this process has threads (database lanes, the executor's own)
            # whose locks a fork could copy held.
            self._pool = ProcessPoolExecutor(
                self._workers, mp_context=multiprocessing.get_context("spawn"), initializer=start_parser
            )
        return self._pool

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        if self._pool is broken:
            self._pool = None
            broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
