"""Gemma 3 specifics beyond the families' shared parity tests (test_llama_parity.py runs "gemma3"
and "gemma3-pattern" there): bfloat16 numerics (the embedding scale rounded to the dtype, norms in
float32), logit softcapping, the sliding layers really windowed, and its checkpoint's tensors."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.models.gemma3.model import Gemma3ForCausalLM
from gpuworker.models.loader import checkpoint_targets, load_model, load_model_config
from tests.gpuworker.checkpoints import make_checkpoint
from tests.gpuworker.models.paged_batch import PagedBatcher


def _logits(model, mc, tokens, dtype=torch.float32):
    batcher = PagedBatcher(mc, dtype=dtype)
    input_ids, positions, meta = batcher.batch([("s", tokens)])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))


def test_bfloat16_checkpoint_matches_transformers(tmp_path):
    path = make_checkpoint(tmp_path, "gemma3", dtype="bfloat16")
    mc = load_model_config(path)
    model = load_model(mc, dtype="auto")
    assert isinstance(model, Gemma3ForCausalLM) and model.embed_tokens.dtype == torch.bfloat16
    # sqrt(64) is exact; a hidden size whose root bfloat16 rounds is what transformers multiplies by.
    assert model.embed_scale(torch.bfloat16) == float(torch.tensor(8.0, dtype=torch.bfloat16))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, mc.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    ours = _logits(model, mc, prompt.tolist(), torch.bfloat16)
    with torch.no_grad():
        reference = hf(prompt[None]).logits[0].float()
    # bf16 attention and norms round differently from transformers' eager ones (we attend in
    # float32); logits of up to the cap (30) agree to bf16 precision, a few to a few of its steps.
    torch.testing.assert_close(ours, reference, rtol=0.05, atol=0.75)
    assert (ours - reference).abs().mean() < 0.1  # about one bfloat16 step at these magnitudes
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_embedding_scale_rounds_in_the_model_dtype():
    model = Gemma3ForCausalLM.__new__(Gemma3ForCausalLM)
    model.config = type("Config", (), {"hidden_size": 3072})()
    assert model.embed_scale(torch.bfloat16) == 55.5  # as transformers: not 55.4256
    assert abs(model.embed_scale(torch.float32) - 3072**0.5) < 1e-5


def test_softcapping_bounds_the_logits(tmp_path):
    mc = load_model_config(make_checkpoint(tmp_path, "gemma3"))
    model = load_model(mc, attn_backend=TorchAttentionBackend())
    logits = _logits(model, mc, list(range(3, 40)))
    assert logits.abs().max() < mc.gemma3.final_logit_softcapping
    # greedy_tokens argmaxes the capped logits.
    hidden = torch.randn(5, mc.hidden_size)
    assert torch.equal(model.greedy_tokens(hidden), model.compute_logits(hidden).argmax(-1))


def test_sliding_layers_attend_through_their_window_only(tmp_path):
    # Tokens before the window change nothing in a model of sliding layers alone; a full layer sees them.
    sliding = ["sliding_attention"] * 3
    for layer_types, same in ((sliding, True), (["sliding_attention", "full_attention", "sliding_attention"], False)):
        path = make_checkpoint(tmp_path / str(same), "gemma3", layer_types=layer_types)
        mc = load_model_config(path)
        model = load_model(mc, attn_backend=TorchAttentionBackend())
        window = mc.gemma3.sliding_window
        # Three layers of a 21-token window reach back 3 * 20 tokens: change only what is further back.
        tail = list(range(100, 100 + 3 * (window - 1) + 1))
        a = _logits(model, mc, [1] * 30 + tail)[-1]
        b = _logits(model, mc, [2] * 30 + tail)[-1]
        assert torch.equal(a, b) == same, (window, layer_types)


def test_checkpoint_has_the_four_norms_per_layer(tmp_path):
    mc = load_model_config(make_checkpoint(tmp_path, "gemma3"))
    model = load_model(mc, attn_backend=TorchAttentionBackend())
    names = set(checkpoint_targets(model))
    for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        assert f"model.layers.0.{norm}_layernorm.weight" in names
    assert "lm_head.weight" not in names  # tied
