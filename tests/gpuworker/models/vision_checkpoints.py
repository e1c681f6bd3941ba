"""Tiny random Qwen2.5-VL checkpoints for tests: transformers' own model saved with its image
processor (small min/max pixels, so images stay a few patches) and the demo byte-level tokenizer.
The image, vision-start and vision-end tokens are ids inside the tiny vocabulary."""

from __future__ import annotations

from pathlib import Path

from gpuworker.demo_model import vision_chat_template, write_tokenizer
from tests.gpuworker.checkpoints import TINY

IMAGE_TOKEN_ID = 380
VISION_START_TOKEN_ID = 381
VISION_END_TOKEN_ID = 382
PATCH = 14


def make_qwen2_5_vl(tmp_path: str | Path, seed: int = 0) -> Path:
    import torch
    import transformers

    text = dict(TINY)
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    config = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config={
            "depth": 3,
            "hidden_size": 32,
            "num_heads": 2,
            "intermediate_size": 48,
            "out_hidden_size": TINY["hidden_size"],
            "patch_size": PATCH,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,  # two merged tokens a side: several windows per test image
            "fullatt_block_indexes": [1],
        },
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=379,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        bos_token_id=TINY["bos_token_id"],
        eos_token_id=TINY["eos_token_id"],
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).float()
    _redraw(model, seed)
    directory = Path(tmp_path) / "qwen2_5_vl"
    model.save_pretrained(str(directory))
    processor = transformers.Qwen2VLImageProcessor(
        min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28, patch_size=PATCH, merge_size=2, temporal_patch_size=2
    )
    processor.save_pretrained(str(directory))
    template = vision_chat_template([VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID])
    write_tokenizer(directory, TINY["vocab_size"], TINY["max_position_embeddings"], template)
    return directory


def _redraw(model, seed: int) -> None:
    """Norms and biases off their trivial values, matrices scaled by fan-in (as checkpoints.py)."""
    import math

    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and not name.endswith(".bias"):
                value = 1.0 + 0.2 * torch.randn(param.shape, generator=generator)
            elif param.dim() == 1:
                value = 0.2 * torch.randn(param.shape, generator=generator)
            elif "embed_tokens" in name or "lm_head" in name:
                value = 0.5 * torch.randn(param.shape, generator=generator)
            else:
                fan_in = param[0].numel()
                value = torch.randn(param.shape, generator=generator) / math.sqrt(fan_in)
            param.copy_(value)


GEMMA3_IMAGE_TOKEN_ID = 370
GEMMA3_BOI_TOKEN_ID = 371
GEMMA3_EOI_TOKEN_ID = 372


def make_gemma3_vision(tmp_path: str | Path, seed: int = 0) -> Path:
    """A tiny Gemma3ForConditionalGeneration: SigLIP at 28 px in 7 px patches (4 x 4), pooled to 4
    tokens an image, over the text layers of checkpoints.py's "gemma3"."""
    import torch
    import transformers

    from tests.gpuworker.checkpoints import FAMILIES

    text = {**TINY, **FAMILIES["gemma3"][1]}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 7,
            "vision_use_head": False,
        },
        mm_tokens_per_image=4,
        image_token_index=GEMMA3_IMAGE_TOKEN_ID,
        boi_token_index=GEMMA3_BOI_TOKEN_ID,
        eoi_token_index=GEMMA3_EOI_TOKEN_ID,
    )
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    _redraw(model, seed)
    directory = Path(tmp_path) / "gemma3_vision"
    model.save_pretrained(str(directory))
    transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(str(directory))
    # As Gemma 3's template: <start_of_image> alone for each image part.
    template = vision_chat_template([GEMMA3_BOI_TOKEN_ID])
    write_tokenizer(directory, TINY["vocab_size"], TINY["max_position_embeddings"], template)
    return directory
