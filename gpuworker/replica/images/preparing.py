"""A chat request's images, from its parts to the model's inputs: refused for a model that takes
no images, counted against the limit, their bytes loaded (data: URLs decoded, allowed URLs
fetched, concurrently) and then decoded and preprocessed in the replica's pool, all within the
request's budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from gpuworker.contract.openai_api import ImageInput, ProtocolError, images_refused_for
from gpuworker.replica.images import ImageLimits
from gpuworker.replica.images.pool import ImagePool
from gpuworker.replica.images.sources import image_bytes


def check_image_count(images: list[ImageInput], limits: ImageLimits) -> None:
    if len(images) > limits.max_images:
        raise ProtocolError(
            f"{images[limits.max_images].param}: the request has {len(images)} images; "
            f"at most {limits.max_images} are accepted",
            param=images[limits.max_images].param,
            code="too_many_images",
        )


async def prepare_images(
    images: list[ImageInput],
    *,
    model_name: str,
    preprocess: Callable[[Any, str], Any] | None,
    limits: ImageLimits,
    pool: ImagePool,
) -> list[Any]:
    """What `preprocess` (the model's; None for a text-only model) made of each image, in order.
    Raises ProtocolError: 400 naming the model or the part, 503 past the budget."""
    if not images:
        return []
    if preprocess is None:
        raise images_refused_for(model_name)
    check_image_count(images, limits)
    started = time.monotonic()
    try:
        async with asyncio.timeout(limits.budget_s):
            loaded = await asyncio.gather(*(image_bytes(image, limits) for image in images))
    except TimeoutError:
        raise ProtocolError(
            f"loading the request's images took longer than its budget of {limits.budget_s:g}s",
            status=503,
            type="service_unavailable",
            code="image_preprocessing_timeout",
        ) from None
    remaining = max(limits.budget_s - (time.monotonic() - started), 0.001)
    return await pool.preprocess(
        preprocess,
        list(zip(images, loaded)),
        max_pixels=limits.max_image_pixels,
        budget_s=remaining,
        low_detail_pixels=limits.low_detail_pixels,
    )
