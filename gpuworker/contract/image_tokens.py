"""How many prompt tokens an image of a given width and height fills, without its pixels: the
replica's own rules for sizing an image (its "low" detail scaling), and the vision families'
resize rules, so that the gateway counts a request's images as the replica will make them.

Standard library only: the gateway imports it.
"""

from __future__ import annotations

import math

# Qwen2-VL's family (Qwen2-VL, Qwen2.5-VL) makes a token of each 28 x 28 pixels (14-pixel patches
# merged 2 x 2), after scaling the image to whole tokens between min_pixels and max_pixels
# (`resized_size`). Their checkpoints' preprocessor_config.json sets max_pixels to 12,845,056
# (16,384 tokens) and min_pixels to 3,136; a checkpoint with a smaller max_pixels makes fewer.
TOKEN_SIDE = 28
IMAGE_PIXELS_PER_TOKEN = TOKEN_SIDE * TOKEN_SIDE
MIN_PIXELS = 56 * 56
MAX_IMAGE_TOKENS = 16384
MAX_PIXELS = MAX_IMAGE_TOKENS * IMAGE_PIXELS_PER_TOKEN

# Families whose encoder makes the same number of tokens of any image, by config.json's model_type
# (the catalog's family): Gemma 3's SigLIP pools each image to its mm_tokens_per_image, 256 in
# every Gemma 3 checkpoint.
FIXED_IMAGE_TOKENS = {"gemma3": 256}


def low_detail_size(width: int, height: int, low_detail_pixels: int) -> tuple[int, int]:
    """The size an image part with "detail": "low" is scaled to before the model's processor:
    at most low_detail_pixels pixels, aspect kept; its own size when already that small."""
    if width * height <= low_detail_pixels:
        return width, height
    scale = math.sqrt(low_detail_pixels / (width * height))
    # Whole pixels, an exact scale's kept whole despite rounding (1024 x 1024 at 512 x 512: 0.5).
    size = (max(1, math.floor(width * scale + 1e-6)), max(1, math.floor(height * scale + 1e-6)))
    if size[0] * size[1] > low_detail_pixels:
        size = (max(1, math.floor(width * scale)), max(1, math.floor(height * scale)))
    return size


def resized_size(
    width: int, height: int, side: int = TOKEN_SIDE, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """The size Qwen2-VL's image processor scales an image to: whole tokens of `side` pixels, as
    many across and down as nearest the image's own sides; then, if that area falls outside
    [min_pixels, max_pixels], the image is scaled as a whole to fit and its sides rounded to whole
    tokens (down when shrinking, up when growing), the aspect kept as closely as they allow."""
    across, down = round(width / side), round(height / side)
    area = across * down * side * side
    if area > max_pixels:
        shrink = math.sqrt(width * height / max_pixels)
        across = max(1, math.floor(width / shrink / side))
        down = max(1, math.floor(height / shrink / side))
    elif area < min_pixels:
        grow = math.sqrt(min_pixels / (width * height))
        across = math.ceil(width * grow / side)
        down = math.ceil(height * grow / side)
    return across * side, down * side


def image_tokens(width: int, height: int, detail: str, low_detail_pixels: int, family: str = "") -> int:
    """The prompt tokens an image of width x height pixels fills on a replica of `family`: its
    fixed count (FIXED_IMAGE_TOKENS), or what Qwen2-VL's processor makes of it, after a "low"
    `detail` image is scaled to low_detail_pixels (MAX_IMAGE_TOKENS at most)."""
    fixed = FIXED_IMAGE_TOKENS.get(family)
    if fixed is not None:
        return fixed
    if detail == "low":
        width, height = low_detail_size(width, height, low_detail_pixels)
    resized_width, resized_height = resized_size(width, height)
    return min(MAX_IMAGE_TOKENS, (resized_width // TOKEN_SIDE) * (resized_height // TOKEN_SIDE))
