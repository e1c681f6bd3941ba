"""ORM work off the event loop: a dedicated thread per lane, and group commit for hot writes.

`Batcher` hands everything submitted while its previous batch was running to one call of a
list-taking service, so under load one transaction serves many requests (credit holds and
settlements are written per request, and a transaction per request would cost more CPU than the
rest of the gateway together).
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from django.db import IntegrityError, close_old_connections

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


class DatabaseLane:
    """One thread (so one database connection) that runs ORM calls in submission order."""

    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"gateway-db-{name}")
        self._checked_at = 0.0

    async def run(self, fn: Callable[..., Result], /, *args: Any, **kwargs: Any) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args, kwargs)

    def close(self) -> None:
        self._executor.submit(_close_connections)
        self._executor.shutdown(wait=True)

    def _call(self, fn, args, kwargs):
        # Drop a connection that broke or outlived CONN_MAX_AGE, as Django does between requests;
        # at most once a second (and after any error), since each check costs a round trip.
        now = time.monotonic()
        if now - self._checked_at > 1.0:
            close_old_connections()
            self._checked_at = now
        try:
            return fn(*args, **kwargs)
        except Exception:
            self._checked_at = 0.0
            raise


def _close_connections() -> None:
    from django.db import connections

    connections.close_all()


class Batcher(Generic[Item, Result]):
    """`await submit(item)` returns `work(items)[i]` for its item; `work` runs on `lane`."""

    def __init__(self, lane: DatabaseLane, work: Callable[[list[Item]], Sequence[Result]], max_items: int = 200):
        self._lane, self._work, self._max_items = lane, work, max_items
        self._pending: list[tuple[Item, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None

    @property
    def idle(self) -> bool:
        """Nothing queued or being written."""
        return self._runner is None and not self._pending

    async def submit(self, item: Item) -> Result:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._runner is None:
            self._runner = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self._max_items], self._pending[self._max_items :]
                try:
                    results = await self._lane.run(self._run, [item for item, _ in batch])
                except Exception as exc:  # the database is down: every caller hears about it
                    results = [exc] * len(batch)
                for (_, future), result in zip(batch, results):
                    if future.done():  # its caller went away; the result still stands
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
        finally:
            self._runner = None

    def _run(self, items: list[Item]) -> list:
        try:
            return list(self._work(items))
        except IntegrityError:
            if len(items) == 1:
                raise
            # One bad item must not fail the others: run them one by one to isolate it.
            logger.warning("a batch of %d failed an integrity check; retrying its items one by one", len(items))
            results: list = []
            for item in items:
                try:
                    results.extend(self._work([item]))
                except Exception as exc:
                    results.append(exc)
            return results
