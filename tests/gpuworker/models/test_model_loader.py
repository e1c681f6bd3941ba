"""Weight loading: shards, fused projections, dummy weights, and errors that name the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gpuworker.models.layers import RMSNorm
from gpuworker.models.loader import load_model, load_tokenizer
from tests.gpuworker.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama-bias")


@pytest.fixture
def llama_copy(llama_dir, tmp_path):
    return shutil.copytree(llama_dir, tmp_path / "copy")


def test_fused_projections_hold_the_hf_tensors_in_order(llama_dir):
    model = load_model(llama_dir)
    hf = load_file(str(llama_dir / "model.safetensors"))
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    p = "model.layers.1."
    for kind in ("weight", "bias"):
        expected_qkv = torch.cat([hf[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, kind), expected_qkv)
        expected_gate_up = torch.cat([hf[f"{p}mlp.{x}_proj.{kind}"] for x in ("gate", "up")])
        assert torch.equal(getattr(mlp.gate_up_proj, kind), expected_gate_up)
    assert torch.equal(model.lm_head, hf["lm_head.weight"])
    assert torch.equal(model.norm.weight, hf["model.norm.weight"])


def test_sharded_checkpoint_with_index(tmp_path):
    path = make_checkpoint(tmp_path, "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(str(path))
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="50KB")
    shutil.copy(path / "tokenizer.json", sharded)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one, many = load_model(path), load_model(sharded)
    for (name, a), (_, b) in zip(one.named_parameters(), many.named_parameters()):
        assert torch.equal(a, b), name


def test_wrong_shape_names_the_tensor_file_and_shapes(llama_copy):
    weights = load_file(str(llama_copy / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(weights, str(llama_copy / "model.safetensors"))
    with pytest.raises(ValueError) as excinfo:
        load_model(llama_copy)
    assert str(excinfo.value) == (
        "model.layers.0.self_attn.k_proj.weight in model.safetensors has shape (64, 64), expected (32, 64)"
    )


def test_missing_tensors_are_named(llama_copy):
    weights = load_file(str(llama_copy / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    del weights["lm_head.weight"]
    save_file(weights, str(llama_copy / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"2 tensor\(s\) missing from model.safetensors: "
        r"lm_head.weight, model.layers.1.mlp.up_proj.weight",
    ):
        load_model(llama_copy)


def test_unexpected_tensors_are_named(llama_copy):
    weights = load_file(str(llama_copy / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: skipped
    weights["model.layers.0.mlp.extra_proj.weight"] = torch.ones(2, 2)
    save_file(weights, str(llama_copy / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"tensors not used by LlamaForCausalLM: "
        r"model.layers.0.mlp.extra_proj.weight \(in model.safetensors\)$",
    ):
        load_model(llama_copy)


def test_missing_weight_files(llama_copy):
    (llama_copy / "model.safetensors").rename(llama_copy / "weights.bin")
    with pytest.raises(
        FileNotFoundError, match="no weights found; expected model.safetensors.index.json or model.safetensors"
    ):
        load_model(llama_copy)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        FileNotFoundError,
        match="model-00001-of-00002.safetensors, listed in .*model.safetensors.index.json, does not exist",
    ):
        load_model(llama_copy)


def test_tied_checkpoint_shares_the_embedding(tmp_path):
    model = load_model(make_checkpoint(tmp_path, "qwen3"))
    assert model.lm_head is None
    assert model.lm_head_weight is model.embed_tokens


def test_dummy_load_reads_only_config_json(llama_copy):
    for file in llama_copy.iterdir():
        if file.name != "config.json":
            file.unlink()
    model = load_model(llama_copy, load_format="dummy", dtype="bfloat16")
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    for module in model.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    weight = params["layers.0.self_attn.qkv_proj.weight"].float()
    assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    # The same seed gives the same weights; the rotary cache stays float32.
    again = load_model(llama_copy, load_format="dummy", dtype="bfloat16")
    assert torch.equal(again.embed_tokens, model.embed_tokens)
    assert model.rotary.cos_cache.dtype == torch.float32


def test_bad_arguments(llama_dir):
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(llama_dir, load_format="pt")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(llama_dir, dtype="float64x")


def test_load_tokenizer(llama_dir, tmp_path):
    tokenizer = load_tokenizer(llama_dir)
    ids = tokenizer("héllo").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "héllo"
    with pytest.raises(FileNotFoundError, match="no tokenizer found; expected one of tokenizer.json"):
        load_tokenizer(tmp_path)


def test_chat_template_from_chat_template_jinja(llama_copy):
    # transformers 5's save_pretrained writes the template beside tokenizer_config.json.
    config_path = llama_copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config.pop("chat_template")
    config_path.write_text(json.dumps(config))
    (llama_copy / "chat_template.jinja").write_text(template.replace("<|eot_id|>", "<|end_of_text|>"))
    messages = [{"role": "user", "content": "hi"}]
    rendered = load_tokenizer(llama_copy).apply_chat_template(messages, tokenize=False)
    assert rendered == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|end_of_text|>"


def test_a_bfloat16_checkpoint_loads_converted_into_float32(tmp_path):
    path = make_checkpoint(tmp_path, "llama", dtype="bfloat16")
    hf = load_file(str(path / "model.safetensors"))
    model = load_model(path, dtype=torch.float32)
    assert model.lm_head.dtype == torch.float32
    assert torch.equal(model.lm_head, hf["lm_head.weight"].float())


def test_a_truncated_shard_is_named_before_any_weight_is_read(llama_copy):
    file = llama_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"in model.safetensors: data offsets .* the file may be truncated"):
        load_model(llama_copy)


def test_a_file_that_is_not_safetensors_is_named(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file"):
        load_model(llama_copy)


def test_one_shard_is_read_by_several_threads_in_byte_ranges_with_the_same_result(llama_dir, monkeypatch):
    from gpuworker.checkpoint_files import read_header
    from gpuworker.models import weight_stream
    from gpuworker.models.weight_stream import TensorCopy, split_plan

    file = llama_dir / "model.safetensors"
    copies = [TensorCopy(e, torch.empty(e.shape, dtype=torch.float32)) for e in read_header(file)]
    runs = split_plan([(file, list(reversed(copies)))], 4)
    # Four runs of consecutive tensors in file order, together every tensor once, of similar size.
    assert len(runs) == 4 and all(f == file and run for f, run in runs)
    assert [c.entry.name for _, run in runs for c in run] == [c.entry.name for c in copies]
    sizes = [sum(c.nbytes for c in run) for _, run in runs]
    assert max(sizes) < 2 * sum(sizes) / 4 + max(c.nbytes for c in copies)
    assert split_plan([(file, copies)], 1) == [(file, copies)]

    monkeypatch.setattr(weight_stream, "MAX_READERS", 1)
    one = load_model(llama_dir)
    monkeypatch.setattr(weight_stream, "MAX_READERS", 8)
    eight = load_model(llama_dir)
    for (name, a), (_, b) in zip(one.named_parameters(), eight.named_parameters()):
        assert torch.equal(a, b), name
