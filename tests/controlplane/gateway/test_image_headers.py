"""An image's size read from its data: URL's header: each format the replica takes, and every URL
whose header is not there (garbage, cut short, metadata past the bytes read, an http URL) as None."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from controlplane.gateway.image_headers import HEADER_BYTES, data_url_image_size


def _file(fmt: str, size: tuple[int, int], **options) -> bytes:
    out = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(out, format=fmt, **options)
    return out.getvalue()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize(
    "fmt, options",
    [
        ("PNG", {}),
        ("JPEG", {"quality": 90}),
        ("JPEG", {"exif": b"Exif\x00\x00" + bytes(30000)}),  # metadata before the frame header
        ("GIF", {}),
        ("WEBP", {}),  # lossy: VP8
        ("WEBP", {"lossless": True}),  # VP8L
        ("WEBP", {"exif": b"Exif\x00\x00" + bytes(100)}),  # extended: VP8X
    ],
)
def test_a_data_urls_size_is_read_from_its_header(fmt, options):
    for size in ((1024, 1024), (640, 37)):
        assert data_url_image_size(_url(_file(fmt, size, **options), f"image/{fmt.lower()}")) == size, (fmt, size)


def test_only_the_header_is_needed_not_the_rest_of_the_image():
    png = _file("PNG", (1024, 768))
    assert len(png) > 4 * HEADER_BYTES
    assert data_url_image_size(_url(png[:100])) == (1024, 768)


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        _url(bytes(1 << 20)),  # no image
        _url(b"\x89PNG\r\n\x1a\n" + bytes(8)),  # a PNG cut inside its header
        _url(_file("JPEG", (64, 64))[:200]),  # a JPEG cut before its frame header
        _url(_file("JPEG", (64, 64), icc_profile=bytes(HEADER_BYTES))),  # metadata longer than read
        _url(b"RIFF\x00\x00\x00\x00WEBPVP8 "),  # a WebP cut inside its first chunk
        "data:image/png;base64,!!!!not base64 at all",
        "data:image/png;base64,iVBORw0KGgo",  # not whole base64 quanta
        "data:image/png," + "%89PNG",  # not base64
        "data:image/png;base64",  # no comma
    ],
)
def test_a_url_whose_header_is_not_there_has_no_size(url):
    assert data_url_image_size(url) is None
