"""Images for the image tests, made in memory: ordinary files of each format, a PNG whose header
claims more pixels than it holds (a decompression bomb), and a JPEG cut short."""

from __future__ import annotations

import base64
import io
import struct
import zlib

from PIL import Image


def image_file(fmt: str = "PNG", size: tuple[int, int] = (64, 48), color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format=fmt)
    return out.getvalue()


def gradient_jpeg(size: int) -> bytes:
    """A large smooth image: cheap to send, real work to decode and resize."""
    row = Image.linear_gradient("L").resize((size, size))
    image = Image.merge("RGB", (row, row.rotate(90), row.rotate(180)))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def two_frame_gif() -> bytes:
    """A GIF whose first frame is red and second blue."""
    out = io.BytesIO()
    frames = [Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))]
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    return out.getvalue()


def bomb_png(width: int, height: int) -> bytes:
    """A PNG of a few bytes whose header says width x height pixels."""
    png = image_file("PNG", (1, 1))
    start = png.index(b"IHDR")
    header = struct.pack(">II", width, height) + png[start + 12 : start + 17]
    chunk = b"IHDR" + header
    return png[: start - 4] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[start + 21 :]


def truncated_jpeg() -> bytes:
    noise = Image.effect_noise((256, 256), 64).convert("RGB")
    out = io.BytesIO()
    noise.save(out, format="JPEG")
    data = out.getvalue()
    return data[: len(data) // 2]


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
