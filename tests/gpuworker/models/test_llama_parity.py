"""Our decoder's logits equal transformers' for every family, through the paged KV cache.

Each family's tiny random checkpoint is run by transformers on whole sequences (the reference)
and by our model the way the engine runs it: one prefill, chunked prefill then token-by-token
decode, and ragged batches mixing sequences, decodes and padding in one forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.models.loader import load_model, load_model_config, model_class
from tests.gpuworker.checkpoints import FAMILIES, make_checkpoint
from tests.gpuworker.models.paged_batch import PagedBatcher

# float32 on both sides; the differences are GEMM rounding (observed ~1e-5 on logits of std ~4).
TOLERANCE = {"rtol": 1e-5, "atol": 1e-4}
LENGTHS = (1, 5, 16, 17, 64, 300)


class Pair:
    """Our model and transformers' on the same checkpoint, with transformers' reference logits."""

    def __init__(self, path):
        self.mc = load_model_config(path)
        self.model = load_model(self.mc, device="cpu", dtype=torch.float32, attn_backend=TorchAttentionBackend())
        self.hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(1234)
        self.prompts = {n: torch.randint(0, self.mc.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS}
        self._reference: dict[int, torch.Tensor] = {}

    def reference(self, n: int) -> torch.Tensor:
        if n not in self._reference:
            with torch.no_grad():
                self._reference[n] = self.hf(torch.tensor([self.prompts[n]])).logits[0].float()
        return self._reference[n]

    def run(self, batcher: PagedBatcher, chunks, pad_to=None) -> torch.Tensor:
        input_ids, positions, meta = batcher.batch(chunks, pad_to=pad_to)
        with torch.no_grad():
            hidden = self.model(input_ids, positions, batcher.kv_caches, meta)
            return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    return Pair(make_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param))


def test_full_prompt_in_one_prefill(pair):
    batcher = PagedBatcher(pair.mc)
    logits = pair.run(batcher, [("s", pair.prompts[300])])
    assert logits.dtype == torch.float32
    assert logits.shape == (300, pair.mc.vocab_size)
    torch.testing.assert_close(logits, pair.reference(300), **TOLERANCE)


def test_prefix_then_chunks_then_decode(pair):
    prompt, reference = pair.prompts[300], pair.reference(300)
    batcher = PagedBatcher(pair.mc, seed=7)
    # Chunk edges fall inside and on block boundaries (block_size 16).
    edges = [0, 37, 48, 130, 250]
    pieces = [pair.run(batcher, [("s", prompt[a:b])]) for a, b in zip(edges, edges[1:])]
    pieces += [pair.run(batcher, [("s", [token])]) for token in prompt[edges[-1] :]]
    torch.testing.assert_close(torch.cat(pieces), reference, **TOLERANCE)
    # The block table really is scattered, not the identity.
    assert batcher.block_tables["s"] != sorted(batcher.block_tables["s"])


def test_ragged_batch_of_fresh_prompts(pair):
    batcher = PagedBatcher(pair.mc, seed=3)
    order = [64, 1, 300, 17, 5, 16]
    logits = pair.run(batcher, [(str(n), pair.prompts[n]) for n in order])
    start = 0
    for n in order:
        torch.testing.assert_close(logits[start : start + n], pair.reference(n), **TOLERANCE)
        start += n


def test_mixed_decodes_and_chunked_prefills_with_padding(pair):
    batcher = PagedBatcher(pair.mc, seed=5)
    # Step 1: three sequences prefill all but their last token, one prefills a first chunk.
    step1 = [
        ("a", pair.prompts[17][:-1]),
        ("b", pair.prompts[64][:-1]),
        ("c", pair.prompts[5][:-1]),
        ("d", pair.prompts[300][:100]),
    ]
    pair.run(batcher, step1)
    # Step 2, in the runner's order: decodes first, then the rest of d's prompt and a new prompt,
    # then padding tokens that must change nothing.
    step2 = [
        ("a", pair.prompts[17][-1:]),
        ("b", pair.prompts[64][-1:]),
        ("c", pair.prompts[5][-1:]),
        ("d", pair.prompts[300][100:]),
        ("e", pair.prompts[16]),
    ]
    num_tokens = 3 + 200 + 16
    logits = pair.run(batcher, step2, pad_to=num_tokens + 5)
    assert logits.shape[0] == num_tokens + 5
    expected = torch.cat(
        [
            pair.reference(17)[-1:],
            pair.reference(64)[-1:],
            pair.reference(5)[-1:],
            pair.reference(300)[100:],
            pair.reference(16),
        ]
    )
    torch.testing.assert_close(logits[:num_tokens], expected, **TOLERANCE)


def test_forward_has_no_data_dependent_control_flow(pair):
    """On the meta device no tensor value can be read: a host sync or a branch on data would fail.

    The attention backend is replaced by a shape-only stand-in; it is not what is under test here
    (its own correctness is covered above and in test_paged_attention_reference.py).
    """

    class ShapeOnlyBackend:
        def forward(self, query, key, value, kv_cache, meta, scale, k_scale, v_scale, **window):
            return query * scale

    mc = pair.mc
    with torch.device("meta"):
        model = model_class(mc)(mc, ShapeOnlyBackend())
    tokens = 7
    caches = [torch.empty(2, 4, 16, mc.num_kv_heads, mc.head_dim, device="meta") for _ in range(mc.num_layers)]
    input_ids = torch.empty(tokens, dtype=torch.int64, device="meta")
    positions = torch.empty(tokens, dtype=torch.int64, device="meta")
    hidden = model(input_ids, positions, caches, meta=None)
    assert hidden.shape == (tokens, mc.hidden_size)
    assert model.compute_logits(hidden).shape == (tokens, mc.vocab_size)


def test_bfloat16_checkpoint_matches_transformers(tmp_path):
    path = make_checkpoint(tmp_path, "llama3.1", dtype="bfloat16")
    mc = load_model_config(path)
    assert mc.torch_dtype == "bfloat16"
    model = load_model(mc, dtype="auto")
    assert model.embed_tokens.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    prompt = torch.randint(0, mc.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    batcher = PagedBatcher(mc, dtype=torch.bfloat16)
    input_ids, positions, meta = batcher.batch([("s", prompt.tolist())])
    with torch.no_grad():
        ours = model.compute_logits(model(input_ids, positions, batcher.kv_caches, meta))
        reference = hf(prompt[None]).logits[0].float()
    # bf16 attention orders its sums differently from transformers; agreement is to bf16 precision.
    torch.testing.assert_close(ours, reference, rtol=0.05, atol=0.15)
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
