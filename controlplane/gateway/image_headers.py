"""An image's width and height read from the start of its data: URL, without decoding its pixels
or the rest of its base64: what the gateway counts a request's image tokens by before routing it
(replica_choice.image_tokens_estimate). Only the replica decodes images, and refuses bad ones.
"""

from __future__ import annotations

import binascii
import io
import struct
import warnings

from PIL import Image

# The bytes read of an image for its header: PNG's and WebP's come first and GIF's after its
# color table, all in the first read; JPEG's follows its metadata segments (EXIF, an ICC profile),
# so a JPEG (or a GIF with long extensions) not sized by the first read gets the second, up to
# HEADER_BYTES. Decoding the base64 is most of the cost, so the first read is short.
FIRST_READ_BYTES = 4 << 10
HEADER_BYTES = 64 << 10
_SECOND_READ_SIGNATURES = (b"\xff\xd8", b"GIF8")
# The formats the replica takes (replica.images.decoding.FORMATS) but WebP, whose header is read
# here: Pillow opens a WebP through libwebp, which wants the whole file.
PILLOW_FORMATS = ("PNG", "JPEG", "GIF")


def data_url_image_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a base64 data: URL's image, from its header within its first HEADER_BYTES
    bytes (FIRST_READ_BYTES but for a JPEG or GIF); None for another URL, or when no header of a
    known format is found there (garbage, cut short, or a JPEG whose metadata runs longer)."""
    if url[:5].lower() != "data:":
        return None
    comma = url.find(",", 5)
    if comma < 0 or not url[:comma].lower().endswith(";base64"):
        return None
    prefix = _decoded_prefix(url, comma + 1, FIRST_READ_BYTES)
    size = image_size(prefix)
    if size is None and len(prefix) >= FIRST_READ_BYTES and prefix.startswith(_SECOND_READ_SIGNATURES):
        size = image_size(_decoded_prefix(url, comma + 1, HEADER_BYTES))
    return size


def _decoded_prefix(url: str, start: int, limit: int) -> bytes:
    """The first `limit` bytes (or fewer, at its end) of the base64 from url[start:]; none if it is
    not base64. Only that much of the URL is copied or decoded, in whole 4-character quanta."""
    chunk = url[start : start + -(-limit // 3) * 4]
    try:
        return binascii.a2b_base64(chunk[: len(chunk) // 4 * 4])
    except binascii.Error:
        return b""


def image_size(prefix: bytes) -> tuple[int, int] | None:
    """(width, height) from the first bytes of a PNG, JPEG, GIF or WebP file; None when they hold
    no such header."""
    if prefix[:4] == b"RIFF" and prefix[8:12] == b"WEBP":
        size = _webp_size(prefix)
    else:
        try:
            # A header claiming more pixels than Pillow's bomb limit warns; the replica refuses it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                size = Image.open(io.BytesIO(prefix), formats=PILLOW_FORMATS).size  # reads the header only
        except Exception:  # a cut or garbage header, however Pillow fails on it, gives no size
            return None
    return size if size is not None and size[0] >= 1 and size[1] >= 1 else None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    """A WebP's canvas from its first chunk: VP8X (extended), VP8L (lossless) or VP8 (lossy)."""
    chunk, body = data[12:16], data[20:30]
    if chunk == b"VP8X" and len(body) >= 10:
        return 1 + int.from_bytes(body[4:7], "little"), 1 + int.from_bytes(body[7:10], "little")
    if chunk == b"VP8L" and len(body) >= 5 and body[0] == 0x2F:
        bits = int.from_bytes(body[1:5], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8 " and len(body) >= 10 and body[3:6] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", body[6:10])
        return width & 0x3FFF, height & 0x3FFF
    return None
