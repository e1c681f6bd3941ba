"""Image decoding and preprocessing in worker processes, off the replica's event loop.

One pool per replica server, its processes as many as the host's cores the replica may use (less
one, which the server and the engine loop keep). Each image runs `decode_and_preprocess` in a
worker: opened with the guards of `decoding`, then handed to the model's preprocessing callable
(which must be picklable: a module-level function or a functools.partial of one). A request's
images share one time budget; past it the request is refused (503) and its images' results
dropped.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable

from gpuworker.contract.openai_api import ImageInput, ProtocolError
from gpuworker.replica.images import DEFAULT_LOW_DETAIL_PIXELS
from gpuworker.replica.images.decoding import ImageRefused, decode_and_preprocess
from gpuworker.replica.images.sources import refused


def pool_size() -> int:
    """Worker processes for this host: its usable cores less one, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


class ImagePool:
    """Worker processes that decode and preprocess images. Started on first use (a text-only
    replica never starts them); `shutdown` stops them."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers if workers is not None else pool_size()
        if self.workers < 1:
            raise ValueError(f"workers: must be at least 1, got {self.workers}")
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # spawn: the server process runs threads (the engine loop's among them), which a
            # forked child would inherit mid-lock.
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self._executor

    async def preprocess(
        self,
        preprocess: Callable[[Any, str], Any],
        images: list[tuple[ImageInput, bytes]],
        *,
        max_pixels: int,
        budget_s: float,
        low_detail_pixels: int = DEFAULT_LOW_DETAIL_PIXELS,
    ) -> list[Any]:
        """Each image decoded, brought to its detail's resolution (`decoding.at_detail`) and run
        through `preprocess` in a worker, in the order given.
        Raises ProtocolError: 400 naming the part of an image that cannot be decoded, 503 when the
        images take longer than budget_s."""
        loop = asyncio.get_running_loop()
        pool = self._pool()
        futures = [
            loop.run_in_executor(
                pool, decode_and_preprocess, preprocess, data, image.detail, max_pixels, low_detail_pixels
            )
            for image, data in images
        ]
        try:
            async with asyncio.timeout(budget_s):
                results = await asyncio.gather(*futures, return_exceptions=True)
        except TimeoutError:
            for future in futures:
                future.cancel()  # those not started yet never run
            raise ProtocolError(
                f"preparing the request's {len(images)} image(s) took longer than its budget of {budget_s:g}s; "
                "the replica is busy, retry later or send fewer or smaller images",
                status=503,
                type="service_unavailable",
                code="image_preprocessing_timeout",
            ) from None
        for (image, _), result in zip(images, results):
            if isinstance(result, ImageRefused):
                raise refused(image, str(result))
            if isinstance(result, BaseException):
                raise result
        return results

    def warm(self) -> None:
        """Start the worker processes now (a vision model's replica, at load), so the first
        request's budget is not spent starting them."""
        pool = self._pool()
        for _ in range(self.workers):
            pool.submit(int)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
