"""A vision model through the replica server with the openai SDK: a chat with data-URL images is
rendered by the model's chat template, its placeholders expanded to the images' tokens, and
answered greedily token for token as transformers answers the same chat and images; usage counts
the image tokens; the same text with another image is a new prompt, not a prefix-cache hit; a
"low" detail image is scaled down to the low-detail budget (fewer tokens, its own cache key); a
streamed answer with an image is the whole one; Gemma 3 too, and an engine in a process of its own."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from gpuworker.engine.multimodal import preprocess_image
from gpuworker.engine.prompts import TokenizedPrompt
from gpuworker.replica.app import ServerConfig
from gpuworker.replica.images import ImageLimits
from gpuworker.replica.responses import with_image_tokens
from tests.gpuworker.models.vision_checkpoints import (
    GEMMA3_BOI_TOKEN_ID,
    GEMMA3_EOI_TOKEN_ID,
    GEMMA3_IMAGE_TOKEN_ID,
    IMAGE_TOKEN_ID,
    make_gemma3_vision,
    make_qwen2_5_vl,
)
from tests.gpuworker.replica.test_app import TOKEN, _serving

MAX_TOKENS = 6
# The tiny processor takes up to 64 x 28 x 28 pixels; "low" detail keeps a quarter of that.
LOW_DETAIL_PIXELS = 112 * 112


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def server(checkpoint):
    config = ServerConfig(
        model=str(checkpoint),
        served_model_name="tiny-vl",
        token=TOKEN,
        max_model_len=1024,
        image_limits=ImageLimits(low_detail_pixels=LOW_DETAIL_PIXELS),
    )
    with _serving(config) as running:
        yield running


def _ask(base: str, pngs: list[bytes], text: str = "what is in the picture", detail: str = "auto", **kwargs):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN)
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": _data_url(png), "detail": detail}} for png in pngs]
    return client.chat.completions.create(
        model="tiny-vl",
        messages=[{"role": "user", "content": parts}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=not kwargs.get("stream"),
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def _hf_answer(checkpoint, pngs: list[bytes], text: str = "what is in the picture") -> tuple[list[str], int]:
    """transformers' greedy tokens (as the server names them) and prompt length for the same chat."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint))
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in pngs]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    kwargs = {}
    if pngs:
        images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
        out = processor(images=images, return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(dim=1) // processor.merge_size**2).tolist())
        ids = [t for token in ids for t in ([token] * next(counts) if token == IMAGE_TOKEN_ID else [token])]
        kwargs = {
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (torch.tensor([ids]) == IMAGE_TOKEN_ID).int(),
        }
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    generated = model.eval().generate(
        torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, **kwargs
    )
    return [tokenizer.decode([t]) for t in generated[0, len(ids) :].tolist()], len(ids)


def _tokens(response) -> list[str]:
    return [entry.token for entry in response.choices[0].logprobs.content]


def test_one_image_answers_as_transformers_and_counts_image_tokens(server, checkpoint):
    base, app = server
    assert app.state.holder.image_preprocessor is not None
    png = _png(90, 60, 1)
    response = _ask(base, [png])
    expected, prompt_len = _hf_answer(checkpoint, [png])
    assert _tokens(response) == expected
    text_only, text_len = _hf_answer(checkpoint, [])
    assert response.usage.prompt_tokens == prompt_len > text_len + 3  # the image's tokens, not only its placeholder
    assert _tokens(_ask(base, [])) == text_only


def test_two_images_of_different_shapes_answer_as_transformers(server, checkpoint):
    base, _ = server
    pngs = [_png(150, 60, 2), _png(70, 130, 3)]
    response = _ask(base, pngs)
    expected, prompt_len = _hf_answer(checkpoint, pngs)
    assert _tokens(response) == expected
    assert response.usage.prompt_tokens == prompt_len


def test_same_text_with_another_image_is_not_a_prefix_cache_hit(server, checkpoint):
    base, _ = server
    first, second = _png(112, 112, 4), _png(112, 112, 5)
    answer = _ask(base, [first], "describe")
    again = _ask(base, [first], "describe")
    other = _ask(base, [second], "describe")
    assert _tokens(again) == _tokens(answer)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    cached = other.usage.prompt_tokens_details.cached_tokens
    # Only the text before the image may be shared: never the image's tokens or what follows.
    assert cached < answer.usage.prompt_tokens - 16
    assert _tokens(other) == _hf_answer(checkpoint, [second], "describe")[0]


def test_a_template_that_places_no_image_is_a_400_naming_messages(server):
    base, app = server
    prompts = app.state.holder.engine.prompts
    image = preprocess_image(prompts.model_config.model_path, Image.open(io.BytesIO(_png(56, 56, 6))))
    with pytest.raises(ValueError, match="^messages: the model's chat template did not place the images"):
        with_image_tokens(prompts, TokenizedPrompt(None, [1, 2, 3]), [image])
    assert len(with_image_tokens(prompts, TokenizedPrompt(None, [1, IMAGE_TOKEN_ID, 3]), [image]).token_ids) == (
        2 + image.num_tokens
    )


def test_low_detail_is_the_image_scaled_down_to_the_low_budget(server):
    base, _ = server
    png = _png(448, 448, 10)  # 4 x the tiny processor's max pixels: it scales the image down itself
    by_hand = io.BytesIO()
    Image.open(io.BytesIO(png)).resize((112, 112), Image.Resampling.BICUBIC).save(by_hand, format="PNG")
    high = _ask(base, [png], "look", detail="high")
    low = _ask(base, [png], "look", detail="low")
    assert low.usage.prompt_tokens < high.usage.prompt_tokens - 8
    # The same image at another resolution is another prefix: only the text before it is shared.
    other = _ask(base, [_png(448, 448, 11)], "look", detail="low")
    assert low.usage.prompt_tokens_details.cached_tokens == other.usage.prompt_tokens_details.cached_tokens
    assert low.usage.prompt_tokens_details.cached_tokens < low.usage.prompt_tokens - 8
    resized = _ask(base, [by_hand.getvalue()], "look", detail="high")
    assert _tokens(resized) == _tokens(low) and resized.usage.prompt_tokens == low.usage.prompt_tokens
    assert _tokens(_ask(base, [png], "look", detail="auto")) == _tokens(high)


def test_an_unknown_detail_is_a_400_naming_it(server):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(server[0], [_png(56, 56, 12)], detail="medium")
    assert caught.value.body["param"] == "messages.0.content.1.image_url.detail"
    assert "'medium' is not one of auto, low, high" in caught.value.body["message"]


def test_a_streamed_answer_with_an_image_is_the_whole_answer_and_counts_its_tokens(server, checkpoint):
    base, _ = server
    png = _png(120, 80, 13)
    whole = _ask(base, [png], "stream it")
    chunks = list(_ask(base, [png], "stream it", stream=True, stream_options={"include_usage": True}))
    texts = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert sum(1 for text in texts if text) > 1
    assert "".join(texts) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, MAX_TOKENS)
    assert usage.prompt_tokens == _hf_answer(checkpoint, [png], "stream it")[1]
    assert usage.prompt_tokens > _hf_answer(checkpoint, [], "stream it")[1] + 3  # the image's tokens


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory):
    return make_gemma3_vision(tmp_path_factory.mktemp("gemma3-vision"))


def _hf_gemma_answer(checkpoint, pngs: list[bytes], text: str) -> tuple[list[str], int]:
    """transformers' greedy tokens for the chat, its images placed as Gemma3Processor places them:
    each <start_of_image> of the template's text replaced by the full image sequence."""
    import transformers

    from gpuworker.demo_model import reserved_token

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint))
    content = [{"type": "text", "text": text}] + [{"type": "image"} for _ in pngs]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    boi, image, eoi = (reserved_token(t) for t in (GEMMA3_BOI_TOKEN_ID, GEMMA3_IMAGE_TOKEN_ID, GEMMA3_EOI_TOKEN_ID))
    rendered = rendered.replace(boi, f"\n\n{boi}{image * 4}{eoi}\n\n")
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32)
    generated = model.eval().generate(
        torch.tensor([ids]),
        pixel_values=pixels,
        token_type_ids=(torch.tensor([ids]) == GEMMA3_IMAGE_TOKEN_ID).long(),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        eos_token_id=None,
    )
    return [tokenizer.decode([t]) for t in generated[0, len(ids) :].tolist()], len(ids)


def test_gemma3_places_each_image_where_its_template_writes_start_of_image(gemma_checkpoint):
    config = ServerConfig(model=str(gemma_checkpoint), served_model_name="tiny-vl", token=TOKEN, max_model_len=256)
    pngs = [_png(40, 30, 7), _png(30, 50, 8)]
    expected, prompt_len = _hf_gemma_answer(gemma_checkpoint, pngs, "compare them")
    with _serving(config) as (base, _):
        response = _ask(base, pngs, "compare them")
    assert _tokens(response) == expected
    assert response.usage.prompt_tokens == prompt_len


def test_an_engine_in_its_own_process_takes_the_images_too(checkpoint):
    config = ServerConfig(
        model=str(checkpoint), served_model_name="tiny-vl", token=TOKEN, max_model_len=1024, engine_process=True
    )
    png = _png(60, 90, 9)
    expected, prompt_len = _hf_answer(checkpoint, [png])
    with _serving(config) as (base, _):
        response = _ask(base, [png])
    assert _tokens(response) == expected and response.usage.prompt_tokens == prompt_len
