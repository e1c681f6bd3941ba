"""Image preprocessing off the event loop: how many 1024 x 1024 JPEGs a second the replica's pool
decodes and resizes, per worker count, and how long a ticker on the event loop (standing in for
the replica's streams) is held while 64 large images are prepared: in the pool, and, for
contrast, on the loop itself.

    PYTHONPATH=. python bench/image_preprocessing.py              # a minute on a few cores
    PYTHONPATH=. python bench/image_preprocessing.py --images 64 --side 2048

Prints a table: images/s and images/s per worker for 1..N workers, then the ticker's gaps (median,
p99, max, in ms; the ticker asks for one every 5 ms) with the images in the pool and on the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import io
import statistics
import time

from PIL import Image

from gpuworker.contract.openai_api import ImageInput
from gpuworker.replica.images.decoding import decode_and_preprocess, resize_to_fit
from gpuworker.replica.images.pool import ImagePool, pool_size

TICK_S = 0.005
MAX_PIXELS = 64 << 20


def gradient_jpeg(side: int) -> bytes:
    ramp = Image.linear_gradient("L").resize((side, side))
    out = io.BytesIO()
    Image.merge("RGB", (ramp, ramp.rotate(90), ramp.rotate(180))).save(out, format="JPEG", quality=90)
    return out.getvalue()


async def _ticker(stop: asyncio.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _throughput(workers: int, images: list[tuple[ImageInput, bytes]], preprocess) -> float:
    pool = ImagePool(workers)
    try:
        await pool.preprocess(preprocess, images[:workers], max_pixels=MAX_PIXELS, budget_s=600)  # started
        started = time.perf_counter()
        await pool.preprocess(preprocess, images, max_pixels=MAX_PIXELS, budget_s=600)
        return len(images) / (time.perf_counter() - started)
    finally:
        pool.shutdown()


async def _gaps(images: list[tuple[ImageInput, bytes]], preprocess, on_loop: bool) -> list[float]:
    pool = ImagePool()
    await pool.preprocess(preprocess, images[:1], max_pixels=MAX_PIXELS, budget_s=600)
    stop, gaps = asyncio.Event(), []
    ticker = asyncio.ensure_future(_ticker(stop, gaps))
    await asyncio.sleep(0.1)
    gaps.clear()
    if on_loop:
        for image, data in images:
            decode_and_preprocess(preprocess, data, image.detail, MAX_PIXELS)
            await asyncio.sleep(0)
    else:
        await pool.preprocess(preprocess, images, max_pixels=MAX_PIXELS, budget_s=600)
    stop.set()
    await ticker
    pool.shutdown()
    return gaps


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(args: argparse.Namespace) -> None:
    data = gradient_jpeg(args.side)
    images = [(ImageInput(f"image {i}", "data:"), data) for i in range(args.images)]
    preprocess = functools.partial(resize_to_fit, max_side=1024)
    print(f"{args.images} JPEGs of {args.side}x{args.side} ({len(data)} bytes), resized to fit 1024 px")
    print(f"pool size for this host: {pool_size()} workers\n")
    print("| workers | images/s | images/s per worker |")
    print("|--------:|---------:|--------------------:|")
    for workers in sorted({1, *range(2, pool_size() + 1, 2), pool_size()}):
        rate = await _throughput(workers, images, preprocess)
        print(f"| {workers} | {rate:.1f} | {rate / workers:.1f} |")
    print("\n| where | ticker gaps median (ms) | p99 (ms) | max (ms) |")
    print("|-------|------------------------:|---------:|---------:|")
    for label, on_loop in (("pool (replica)", False), ("event loop (contrast)", True)):
        gaps = await _gaps(images, preprocess, on_loop)
        print(f"| {label} | {statistics.median(gaps) * 1000:.1f} | {_ms(gaps, 0.99):.1f} | {max(gaps) * 1000:.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--side", type=int, default=2048)
    asyncio.run(main(parser.parse_args()))
