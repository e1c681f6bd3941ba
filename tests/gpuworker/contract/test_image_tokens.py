"""The image token counts the gateway routes by are the replica's own: its preprocessing (the
checkpoint's image processor, through engine.multimodal.preprocess_image) of images of each size."""

from __future__ import annotations

import pytest
from PIL import Image

from gpuworker.contract.image_tokens import (
    FIXED_IMAGE_TOKENS,
    MAX_IMAGE_TOKENS,
    MAX_PIXELS,
    MIN_PIXELS,
    image_tokens,
    low_detail_size,
)
from gpuworker.replica.images.decoding import at_detail


@pytest.fixture(scope="module")
def qwen_processor_dir(tmp_path_factory):
    """A checkpoint's image processor as Qwen2.5-VL's preprocessor_config.json sets it."""
    transformers = pytest.importorskip("transformers")
    directory = tmp_path_factory.mktemp("qwen2_5_vl_processor")
    transformers.Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=14, merge_size=2, temporal_patch_size=2
    ).save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize(
    "size", [(1024, 1024), (640, 480), (1000, 37), (20, 20), (1, 1), (3000, 200), (2048, 1536), (1023, 1025)]
)
@pytest.mark.parametrize("detail", ["auto", "low"])
def test_an_images_tokens_are_what_the_replicas_preprocessing_makes_of_it(qwen_processor_dir, size, detail):
    from gpuworker.engine.multimodal import preprocess_image

    image = at_detail(Image.new("RGB", size, (10, 120, 200)), detail, 512 * 512)
    replica = preprocess_image(qwen_processor_dir, image).num_tokens
    assert image_tokens(*size, detail, 512 * 512) == replica


def test_a_1024_square_image_fills_1369_tokens_and_none_fills_more_than_the_cap():
    assert image_tokens(1024, 1024, "auto", 512 * 512) == 37 * 37 == 1369
    assert image_tokens(1024, 1024, "low", 512 * 512) == 18 * 18  # 512 x 512 first: 504 x 504
    assert image_tokens(8192, 8192, "auto", 512 * 512) == MAX_IMAGE_TOKENS
    assert image_tokens(4000, 3000, "auto", 512 * 512, family="gemma3") == FIXED_IMAGE_TOKENS["gemma3"] == 256


def test_low_detail_keeps_a_small_image_and_scales_a_large_one_within_the_budget():
    assert low_detail_size(300, 200, 512 * 512) == (300, 200)
    assert low_detail_size(1024, 1024, 512 * 512) == (512, 512)
    width, height = low_detail_size(4000, 3001, 512 * 512)
    assert width * height <= 512 * 512 and abs(width / height - 4000 / 3001) < 0.01
