"""Qwen2.5-VL through the engine against transformers: greedy tokens equal on a tiny random
checkpoint (float32, CPU) with zero, one and two images of different sizes and aspect ratios; the
prefix cache never shares KV between the same text with different images; chunked prefill splits
an image; a text-only model refuses images by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gpuworker.engine.llm_engine import LLMEngine
from gpuworker.engine.multimodal import expand_image_tokens, preprocess_image
from gpuworker.engine.sampling_params import SamplingParams
from tests.gpuworker.checkpoints import make_checkpoint
from tests.gpuworker.models.vision_checkpoints import (
    IMAGE_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    make_qwen2_5_vl,
)

MAX_TOKENS = 6


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


def _prompt(num_images: int) -> list[int]:
    ids = [10, 20, 30]
    for i in range(num_images):
        ids += [VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, 40 + i]
    return ids + [50, 60]


def _hf_greedy(path, ids: list[int], images: list) -> list[int]:
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    kwargs = {}
    if images:
        kwargs["pixel_values"] = torch.cat([image.pixel_values for image in images])
        kwargs["image_grid_thw"] = torch.tensor([image.grid_thw for image in images])
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == IMAGE_TOKEN_ID).int()
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(ids) :].tolist()


def _engine(path, **config) -> LLMEngine:
    return LLMEngine(path, device="cpu", dtype="float32", max_model_len=512, block_size=16, **config)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_greedy_matches_transformers_with_zero_one_and_two_images(checkpoint):
    wide, tall = _image(150, 60, 1), _image(70, 130, 2)
    inputs = [preprocess_image(checkpoint, image) for image in (wide, tall)]
    assert inputs[0].grid_thw != inputs[1].grid_thw
    engine = _engine(checkpoint)
    cases = [[], inputs[:1], inputs]
    prompts = [expand_image_tokens(_prompt(len(images)), images, IMAGE_TOKEN_ID) for images in cases]
    outputs = engine.generate(prompts, PARAMS, images=[images or None for images in cases])
    for ids, images, output in zip(prompts, cases, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, images), len(images)


def test_same_text_with_different_images_never_shares_kv(checkpoint):
    first, second = (preprocess_image(checkpoint, _image(112, 112, seed)) for seed in (3, 4))
    assert first.num_tokens == second.num_tokens and first.content_hash != second.content_hash
    engine = _engine(checkpoint)
    ids = expand_image_tokens(_prompt(1), [first], IMAGE_TOKEN_ID)
    assert ids == expand_image_tokens(_prompt(1), [second], IMAGE_TOKEN_ID)  # the very same token ids
    (a,) = engine.generate([ids], PARAMS, images=[[first]])
    (b,) = engine.generate([ids], PARAMS, images=[[second]])
    (again,) = engine.generate([ids], PARAMS, images=[[first]])
    assert b.num_cached_tokens < 16  # nothing past the text before the image is shared
    assert again.num_cached_tokens >= 16  # the same image is served from the cache
    assert b.outputs[0].token_ids == _hf_greedy(checkpoint, ids, [second])
    assert again.outputs[0].token_ids == a.outputs[0].token_ids


def test_chunked_prefill_splits_an_image(checkpoint):
    image = preprocess_image(checkpoint, _image(200, 90, 5))
    ids = expand_image_tokens(_prompt(1), [image], IMAGE_TOKEN_ID)
    assert image.num_tokens > 8
    engine = _engine(checkpoint, max_num_batched_tokens=8)
    (output,) = engine.generate([ids], PARAMS, images=[[image]])
    assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, [image])


def test_text_only_model_refuses_images_by_name(tmp_path, checkpoint):
    path = make_checkpoint(tmp_path, "qwen2")
    image = preprocess_image(checkpoint, _image(56, 56, 6))
    engine = _engine(path)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM.*text-only"):
        engine.add_request("r", [1, 2, 3], PARAMS, images=[image])


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]), "mrope_section"),
        (lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config.hidden_act"),
        (lambda c: c["vision_config"].update(fullatt_block_indexes=[7]), "fullatt_block_indexes"),
        (lambda c: c.pop("image_token_id"), "image_token_id"),
    ],
)
def test_bad_vision_fields_are_refused_by_name(checkpoint, edit, field):
    import json

    from gpuworker.models.config import ModelConfig

    config = json.loads((checkpoint / "config.json").read_text())
    assert ModelConfig.from_hf(config).vision.image_token_id == IMAGE_TOKEN_ID
    edit(config)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(config)


def test_multimodal_rotary_positions_continue_after_the_image():
    from gpuworker.engine.multimodal import ImageInput, multimodal_rotary

    image = ImageInput(torch.zeros(1), (1, 4, 6), 6, "h")  # 2 x 3 merged tokens
    positions, delta = multimodal_rotary(10, [image], [2], merge_size=2)
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert positions[:, 8:].tolist() == [[5, 6]] * 3  # 2 + max(2, 3)
    assert delta == 7 - 10


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
async def test_images_pass_through_the_streaming_engines(checkpoint, process):
    import asyncio

    from gpuworker.engine import start_engine

    image = preprocess_image(checkpoint, _image(150, 60, 1))
    ids = expand_image_tokens(_prompt(1), [image], IMAGE_TOKEN_ID)
    engine = start_engine(checkpoint, process=process, device="cpu", dtype="float32", max_model_len=512)
    try:
        outputs = [out async for out in engine.generate(ids, PARAMS, "r", images=[image])]
    finally:
        await asyncio.to_thread(engine.shutdown)
    assert outputs[-1].token_ids == _hf_greedy(checkpoint, ids, [image])
    assert outputs[-1].num_cached_tokens == 0


def test_encoder_batches_a_steps_images_and_caches_them_by_content(checkpoint):
    images = [preprocess_image(checkpoint, _image(w, h, seed)) for w, h, seed in ((150, 60, 1), (70, 130, 2))]
    engine = _engine(checkpoint)
    model = engine.runner.model
    calls = []
    encode = model.encode_images
    model.encode_images = lambda pixels, grids: calls.append(list(grids)) or encode(pixels, grids)
    prompts = [expand_image_tokens(_prompt(1), [image], IMAGE_TOKEN_ID) for image in images]
    first = engine.generate(prompts, PARAMS, images=[[image] for image in images])
    assert calls == [[images[0].grid_thw, images[1].grid_thw]]  # two requests, one encoder call
    # The same image after other text (no prefix-cache hit): its embeddings come from the cache.
    (again,) = engine.generate([[11] + prompts[0]], PARAMS, images=[[images[0]]])
    assert again.num_cached_tokens == 0
    assert len(calls) == 1 and engine.runner.image_cache.hits >= 1
    assert again.outputs[0].token_ids == _hf_greedy(checkpoint, [11] + prompts[0], images[:1])
    assert first[0].outputs[0].token_ids == _hf_greedy(checkpoint, prompts[0], images[:1])


def test_prefills_with_images_run_the_fused_triton_launches(checkpoint, monkeypatch):
    """On the Triton backend (interpreted) a prefill with images takes text's launches: its
    multimodal rotary and cache write in the rotary kernel, then the prefill kernel; no separate
    cache-write launch. A small budget chunks the images (later chunks attend to a cached prefix)
    and puts decodes in the same steps as image chunks."""
    from gpuworker.attention.triton_backend import TritonAttentionBackend
    from tests.kernels.sm90_compile import record_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = record_launches(monkeypatch)
    inputs = [preprocess_image(checkpoint, image) for image in (_image(150, 60, 1), _image(70, 130, 2))]
    cases = [[], inputs[:1], inputs]
    prompts = [expand_image_tokens(_prompt(len(images)), images, IMAGE_TOKEN_ID) for images in cases]
    engine = _engine(checkpoint, attn_backend=TritonAttentionBackend(), max_num_batched_tokens=8)
    outputs = engine.generate(prompts, PARAMS, images=[images or None for images in cases])
    for ids, images, output in zip(prompts, cases, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, images), len(images)
    assert launches["_rotary_kernel"] and launches["_prefill_attention_kernel"]
    assert not launches["_kv_cache_write_kernel"]
