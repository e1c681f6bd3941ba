"""The model runner's grouping of a step's new images into vision-encoder calls: at most
MAX_ENCODER_PATCHES patch rows a call (the rows the KV sizing leaves room for), counted from the
pixels whether the processor gave patch rows (Qwen2.5-VL) or whole pictures (Gemma 3)."""

from types import SimpleNamespace

import torch

from gpuworker.engine.model_runner import encoder_batches
from gpuworker.engine.sizing import MAX_ENCODER_PATCHES


def _image(*shape: int) -> SimpleNamespace:
    return SimpleNamespace(pixel_values=torch.empty(()).expand(*shape))  # the shape without the memory


def test_gemma_pictures_count_their_patches_not_their_pictures():
    patch_values = 3 * 14 * 14  # SigLIP at 896 px: 64 x 64 = 4,096 patches a picture
    pictures = [_image(1, 3, 896, 896) for _ in range(20)]
    groups = encoder_batches(pictures, patch_values)
    assert [len(group) for group in groups] == [16, 4]
    assert 16 * 4096 == MAX_ENCODER_PATCHES


def test_qwen_patch_rows_are_grouped_and_a_larger_image_goes_alone():
    patch_values = 3 * 2 * 14 * 14  # a row: channels x frames x patch x patch
    images = [_image(rows, patch_values) for rows in (30000, 30000, 10000, 70000, 100)]
    groups = encoder_batches(images, patch_values)
    assert [[image.pixel_values.shape[0] for image in group] for group in groups] == [
        [30000, 30000],
        [10000],
        [70000],
        [100],
    ]
