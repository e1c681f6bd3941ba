"""A DeepSeek-V3 model served through the gateway: a replica of a tiny random DeepSeek-V3 checkpoint
(multi-head latent attention with q_lora_rank, grouped top-k sigmoid routing with its correction
bias, YaRN) answers the official `openai` SDK's chat completions, non-streamed and streamed, with
the greedy tokens transformers gives on the same chat-templated prompt, billed once per request."""

from __future__ import annotations

import os
from decimal import Decimal

import pytest

from tests.controlplane.gateway.conftest import make_world, start_module_gateway, start_replica, wait_ready

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Say hello to DeepSeek."}]
MAX_TOKENS = 8
PRICE = Decimal("0.002")


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    from tests.gpuworker.models.deepseek_checkpoints import make_mla_checkpoint

    return make_mla_checkpoint(tmp_path_factory.mktemp("deepseek-checkpoint"), "deepseek-v3-moe")


@pytest.fixture(scope="module")
def deepseek_replica(deepseek_checkpoint):
    replica = start_replica(deepseek_checkpoint, "tiny-deepseek-v3", env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        yield replica
    finally:
        replica.kill()


@pytest.fixture(scope="module")
def deepseek_gateway(deepseek_replica, database_url):
    server = start_module_gateway(database_url)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(deepseek_checkpoint):
    """(prompt token ids, transformers' greedy tokens each as text, their text) for MESSAGES, after
    checking that the engine gives the same tokens on the same prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpuworker.engine import LLMEngine, SamplingParams
    from gpuworker.models.loader import load_tokenizer

    tokenizer = load_tokenizer(deepseek_checkpoint)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    hf = AutoModelForCausalLM.from_pretrained(str(deepseek_checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    tokens = out[0, ids.shape[1] :].tolist()
    engine = LLMEngine(deepseek_checkpoint, device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = engine.generate([prompt], params)
    assert output.outputs[0].token_ids == tokens  # the engine's greedy tokens are transformers'
    return prompt, [tokenizer.decode([token]) for token in tokens], output.outputs[0].text


def _billed_once(request_id: str) -> None:
    from controlplane.billing.models import UsageRecord

    [record] = UsageRecord.objects.filter(request_id=request_id)
    assert (record.status, record.completion_tokens, record.price_charged) == ("completed", MAX_TOKENS, PRICE)


def test_a_deepseek_v3_replica_answers_chat_with_the_reference_tokens(deepseek_gateway, deepseek_replica, reference):
    prompt, tokens, text = reference
    wait_ready(deepseek_replica)
    world = make_world(deepseek_gateway, [deepseek_replica], price=PRICE)
    client = world.client()
    common = {
        "model": world.model.public_name,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    response = client.chat.completions.with_raw_response.create(logprobs=True, **common)
    chat = response.parse()
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == "length"
    assert [entry.token for entry in chat.choices[0].logprobs.content] == tokens  # token for token
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), len(tokens))

    with client.chat.completions.with_streaming_response.create(
        stream=True, stream_options={"include_usage": True}, **common
    ) as streamed:
        stream_id = streamed.headers["x-request-id"]
        chunks = list(streamed.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS

    world.settled()
    _billed_once(response.headers["x-request-id"])
    _billed_once(stream_id)
