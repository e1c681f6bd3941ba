"""Gemma 3 with images through the engine against transformers (tiny random checkpoint, float32,
CPU): greedy tokens equal with zero, one and two images of different sizes and aspect ratios, the
image tokens attending to each other both ways as transformers masks them; a chunk budget that
would cut an image moves the cut before it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from gpuworker.engine.llm_engine import LLMEngine
from gpuworker.engine.multimodal import expand_image_tokens, preprocess_image
from gpuworker.engine.sampling_params import SamplingParams
from tests.gpuworker.models.vision_checkpoints import (
    GEMMA3_BOI_TOKEN_ID,
    GEMMA3_EOI_TOKEN_ID,
    GEMMA3_IMAGE_TOKEN_ID,
    make_gemma3_vision,
)

MAX_TOKENS = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3v"))


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(num_images: int) -> list[int]:
    ids = [2, 10, 20, 30, 31, 32, 33]
    for i in range(num_images):
        ids += [GEMMA3_BOI_TOKEN_ID, GEMMA3_IMAGE_TOKEN_ID, GEMMA3_EOI_TOKEN_ID, 40 + i]
    return ids + [50, 60]


def _hf_greedy(path, ids: list[int], images: list) -> list[int]:
    import transformers

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    kwargs = {}
    if images:
        kwargs["pixel_values"] = torch.cat([image.pixel_values for image in images])
        kwargs["token_type_ids"] = (torch.tensor([ids]) == GEMMA3_IMAGE_TOKEN_ID).long()
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, **kwargs)
    return out[0, len(ids) :].tolist()


def _engine(path, **config) -> LLMEngine:
    return LLMEngine(path, device="cpu", dtype="float32", max_model_len=256, block_size=16, **config)


def test_greedy_matches_transformers_with_zero_one_and_two_images(checkpoint):
    images = [preprocess_image(checkpoint, _image(w, h, seed)) for w, h, seed in ((90, 40, 1), (30, 80, 2))]
    assert images[0].num_tokens == 4 and images[0].content_hash != images[1].content_hash
    engine = _engine(checkpoint)
    cases = [[], images[:1], images]
    prompts = [expand_image_tokens(_prompt(len(c)), c, GEMMA3_IMAGE_TOKEN_ID) for c in cases]
    outputs = engine.generate(prompts, PARAMS, images=[c or None for c in cases])
    for ids, case, output in zip(prompts, cases, outputs):
        assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, case), len(case)


def test_chunks_never_end_inside_an_image(checkpoint):
    image = preprocess_image(checkpoint, _image(50, 50, 3))
    ids = expand_image_tokens(_prompt(1), [image], GEMMA3_IMAGE_TOKEN_ID)
    # A budget of 9 would end the first chunk two tokens into the image (which starts at 8).
    engine = _engine(checkpoint, max_num_batched_tokens=9)
    (output,) = engine.generate([ids], PARAMS, images=[[image]])
    assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, [image])


def test_same_text_with_different_images_never_shares_kv(checkpoint):
    first, second = (preprocess_image(checkpoint, _image(40, 40, seed)) for seed in (4, 5))
    engine = _engine(checkpoint)
    ids = [2] + list(range(10, 24)) + expand_image_tokens([GEMMA3_IMAGE_TOKEN_ID], [first], GEMMA3_IMAGE_TOKEN_ID)
    ids += list(range(60, 80))
    engine.generate([ids], PARAMS, images=[[first]])
    (b,) = engine.generate([ids], PARAMS, images=[[second]])
    assert b.num_cached_tokens == 0  # the first block already holds image tokens
    assert b.outputs[0].token_ids == _hf_greedy(checkpoint, ids, [second])


def test_logits_match_transformers_bidirectional_mask_within_the_image(checkpoint):
    import transformers

    from gpuworker.models.gemma3.image_model import Gemma3ForConditionalGeneration
    from gpuworker.models.loader import load_model, load_model_config
    from tests.gpuworker.models.paged_batch import PagedBatcher

    image = preprocess_image(checkpoint, _image(90, 40, 1))
    ids = expand_image_tokens(_prompt(1), [image], GEMMA3_IMAGE_TOKEN_ID)
    start = ids.index(GEMMA3_IMAGE_TOKEN_ID)
    mc = load_model_config(checkpoint)
    model = load_model(mc)
    assert isinstance(model, Gemma3ForConditionalGeneration)
    batcher = PagedBatcher(mc)
    input_ids, positions, meta = batcher.batch([("s", ids)])
    rows = torch.arange(start, start + image.num_tokens)
    meta.span_ends = torch.arange(len(ids), dtype=torch.int32)
    meta.span_ends[rows] = start + image.num_tokens - 1
    with torch.no_grad():
        embeds = model.encode_images(image.pixel_values, [image.grid_thw])
        hidden = model(input_ids, positions, batcher.kv_caches, meta, rows, embeds)
        ours = model.compute_logits(hidden)
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        both_ways = hf(x, pixel_values=image.pixel_values, token_type_ids=(x == GEMMA3_IMAGE_TOKEN_ID).long())
        causal = hf(x, pixel_values=image.pixel_values)
    torch.testing.assert_close(ours, both_ways.logits[0], rtol=1e-4, atol=1e-4)
    assert (both_ways.logits[0] - causal.logits[0]).abs().max() > 0.1  # the mask matters here


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda c: c["vision_config"].update(hidden_act="relu"), "vision_config.hidden_act"),
        (lambda c: c["vision_config"].update(vision_use_head=True), "vision_config.vision_use_head"),
        (lambda c: c.update(mm_tokens_per_image=3), "mm_tokens_per_image"),
        (lambda c: c.pop("image_token_index"), "image_token_index"),
    ],
)
def test_bad_vision_fields_are_refused_by_name(checkpoint, edit, field):
    import json

    from gpuworker.models.config import ModelConfig

    config = json.loads((checkpoint / "config.json").read_text())
    assert ModelConfig.from_hf(config).vision.tokens_per_image == 4
    edit(config)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(config)


def test_image_runs_that_do_not_match_the_images_are_refused_by_model_name(checkpoint):
    image = preprocess_image(checkpoint, _image(40, 40, 7))
    engine = _engine(checkpoint)
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*1 run"):
        engine.add_request("a", _prompt(1), PARAMS, images=[image, image])  # placeholder not expanded
    with pytest.raises(ValueError, match="image 0 fills 4 tokens but its run has 1"):
        engine.add_request("b", _prompt(1), PARAMS, images=[image])
    with pytest.raises(ValueError, match="more image tokens"):
        expand_image_tokens(_prompt(2), [image], GEMMA3_IMAGE_TOKEN_ID)


def test_the_image_boundary_token_ids_are_read_and_checked(checkpoint):
    import json

    from gpuworker.models.gemma3.vision import parse_siglip

    config = json.loads((checkpoint / "config.json").read_text())
    layout = parse_siglip(config, "tiny")
    assert (layout.boi_token_id, layout.eoi_token_id) == (GEMMA3_BOI_TOKEN_ID, GEMMA3_EOI_TOKEN_ID)
    with pytest.raises(ValueError, match="tiny: boi_token_index must be a token id"):
        parse_siglip({**config, "boi_token_index": "<start_of_image>"}, "tiny")


def test_image_tokens_attend_within_their_image_in_the_triton_prefill_kernel(checkpoint, monkeypatch):
    """On the Triton backend (interpreted) the prefill kernel itself lets each image token see to
    its image's end (span_ends), on the sliding and the full layers, in chunks after a cached
    prefix: the text's fused launches, no cache-write launch and no pass over the images after."""
    from gpuworker.attention.triton_backend import TritonAttentionBackend
    from tests.kernels.sm90_compile import record_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = record_launches(monkeypatch)
    images = [preprocess_image(checkpoint, _image(w, h, seed)) for w, h, seed in ((90, 40, 1), (30, 80, 2))]
    ids = [2, *range(10, 30), *expand_image_tokens(_prompt(2)[1:], images, GEMMA3_IMAGE_TOKEN_ID)]
    engine = _engine(checkpoint, attn_backend=TritonAttentionBackend(), max_num_batched_tokens=16)
    (output,) = engine.generate([ids], PARAMS, images=[images])
    assert output.outputs[0].token_ids == _hf_greedy(checkpoint, ids, images)
    spans = [launch for launch in launches["_prefill_attention_kernel"] if launch.arguments["SPANS"]]
    assert {launch.arguments["WINDOW"] for launch in spans} == {0, 21}
    assert not launches["_kv_cache_write_kernel"]
