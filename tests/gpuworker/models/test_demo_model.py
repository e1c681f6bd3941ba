"""The demo checkpoint loads in transformers and in our loader, and its tokenizer and chat work."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpuworker.demo_model import NOISE_NOTICE, build_tokenizer, main
from gpuworker.models.loader import load_model, load_model_config, load_tokenizer
from tests.gpuworker.models.paged_batch import PagedBatcher

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Grüß dich 👋 "}]
RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nGrüß dich 👋<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "demo"
    assert (
        main(
            [
                str(path),
                "--hidden",
                "32",
                "--layers",
                "3",
                "--heads",
                "4",
                "--kv-heads",
                "1",
                "--vocab",
                "300",
                "--max-position-embeddings",
                "512",
            ]
        )
        == 0
    )
    return path


def test_writes_a_hugging_face_directory_and_says_it_is_noise(tmp_path, capsys):
    main([str(tmp_path / "d")])
    out = capsys.readouterr().out
    assert NOISE_NOTICE in out and "random noise" in out
    names = {p.name for p in (tmp_path / "d").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= names


def test_config_follows_the_flags(demo_dir):
    mc = load_model_config(demo_dir)
    assert (mc.architecture, mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (
        "LlamaForCausalLM",
        32,
        3,
        4,
        1,
    )
    assert (mc.vocab_size, mc.max_position_embeddings, mc.bos_token_id) == (300, 512, 256)
    assert mc.eos_token_ids == [257, 260]


def test_chat_template_renders_in_ours_and_transformers(demo_dir):
    theirs = AutoTokenizer.from_pretrained(str(demo_dir), local_files_only=True)
    for tokenizer in (load_tokenizer(demo_dir), theirs):
        assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == RENDERED
        assert tokenizer.eos_token == "<|eot_id|>" and tokenizer.bos_token_id == 256
        assert len(tokenizer) == 300


def test_tokenizer_is_byte_level_and_every_id_decodes(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    text = "naïve café 👋\n\ttabs"
    ids = tokenizer(text).input_ids
    assert ids == [256] + list(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    for token_id in range(len(tokenizer)):
        assert isinstance(tokenizer.convert_ids_to_tokens(token_id), str)


def test_our_logits_equal_transformers_on_a_chat_prompt(demo_dir):
    tokenizer = load_tokenizer(demo_dir)
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    mc = load_model_config(demo_dir)
    model = load_model(mc)
    hf = AutoModelForCausalLM.from_pretrained(str(demo_dir), dtype=torch.float32).eval()
    batcher = PagedBatcher(mc)
    input_ids, positions, meta = batcher.batch([("chat", ids)])
    with torch.no_grad():
        ours = model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))
        reference = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_rejects_bad_sizes(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--vocab", "100"])
    assert "--vocab must be at least 261" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--heads", "3", "--kv-heads", "2"])
    with pytest.raises(ValueError, match="vocab_size must be at least 261"):
        build_tokenizer(200)
