"""Image bytes opened with Pillow, guarded: only PNG, JPEG, WebP and GIF (its first frame); the
pixel count read from the header and refused above the limit before anything is decoded (a
decompression bomb is a small file whose header claims billions of pixels); truncated or corrupt
files refused instead of decoded as far as they go; an image sent with "detail": "low" scaled down
to the low-detail budget. Runs in the pool's worker processes."""

from __future__ import annotations

import io
from typing import Any, Callable

from PIL import Image, UnidentifiedImageError

from gpuworker.contract.image_tokens import low_detail_size
from gpuworker.replica.images import DEFAULT_LOW_DETAIL_PIXELS

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


class ImageRefused(ValueError):
    """An image that cannot be served, with the reason in words (the caller names the part)."""


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The image as RGB, fully decoded, or ImageRefused saying why not."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
    except UnidentifiedImageError:
        raise ImageRefused(f"not a PNG, JPEG, WebP or GIF image ({len(data)} bytes)") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageRefused(f"cannot read the image: {exc}") from None
    except Image.DecompressionBombError as exc:
        raise ImageRefused(f"the image is too large to decode: {exc}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageRefused(f"the image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise ImageRefused(
            f"the image is {width}x{height} ({width * height} pixels); at most {max_pixels} pixels are accepted"
        )
    try:
        image.seek(0)  # a GIF's first frame
        image.load()  # a truncated file raises here (ImageFile.LOAD_TRUNCATED_IMAGES stays False)
    except Image.DecompressionBombError as exc:
        raise ImageRefused(f"the image is too large to decode: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRefused(f"the image is truncated or corrupt: {exc}") from None
    return image.convert("RGB")


def at_detail(image: Image.Image, detail: str, low_detail_pixels: int) -> Image.Image:
    """The image a part's `detail` asks for: for "low", scaled down (aspect kept, bicubic) to at most
    low_detail_pixels pixels; otherwise, or when it is already that small, the image itself (the
    model's processor then picks the resolution)."""
    size = low_detail_size(*image.size, low_detail_pixels) if detail == "low" else image.size
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def resize_to_fit(image: Image.Image, detail: str, max_side: int = 1024) -> Any:
    """A plain preprocessing: the image scaled down to fit max_side, as its RGB bytes and size. The
    pool's test and bench use it; a vision model brings its own."""
    image = image.copy()
    image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
    return image.tobytes(), image.size


def decode_and_preprocess(
    preprocess: Callable[[Image.Image, str], Any],
    data: bytes,
    detail: str,
    max_pixels: int,
    low_detail_pixels: int = DEFAULT_LOW_DETAIL_PIXELS,
) -> Any:
    """What one worker process does for one image: open it, guarded, bring it to its detail's
    resolution and run `preprocess` on it."""
    return preprocess(at_detail(open_image(data, max_pixels), detail, low_detail_pixels), detail)
