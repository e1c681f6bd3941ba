"""DeepSeek-V2/V3 (multi-head latent attention) against transformers on tiny random checkpoints:
logits and greedy tokens through the paged latent cache, in one prefill, in chunks with absorbed
decodes, and in mixed ragged batches; float32 on CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.models.deepseek.model import DeepseekForCausalLM
from gpuworker.models.loader import load_model, load_model_config
from tests.gpuworker.models.deepseek_checkpoints import MLA_FAMILIES, make_mla_checkpoint
from tests.gpuworker.models.paged_batch import PagedBatcher

# Absorbed decodes reorder the products of the expanded reference: rounding of float32, ~1e-5.
TOLERANCE = {"rtol": 1e-4, "atol": 2e-4}
LENGTHS = (1, 5, 17, 64, 300)


class LatentBatcher(PagedBatcher):
    """PagedBatcher over the latent cache's layout, [1, blocks, block_size, 1, kv_lora_rank + rope]."""

    def __init__(self, mc, num_blocks: int = 64, block_size: int = 16, seed: int = 0) -> None:
        super().__init__(mc, num_blocks=num_blocks, block_size=block_size, seed=seed)
        planes, heads, width = mc.kv_cache_layout
        self.kv_caches = [torch.zeros(planes, num_blocks, block_size, heads, width) for _ in range(mc.num_layers)]


class Pair:
    def __init__(self, path) -> None:
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

    def run(self, batcher, chunks, pad_to=None) -> torch.Tensor:
        input_ids, positions, meta = batcher.batch(chunks, pad_to=pad_to)
        with torch.no_grad():
            return self.model.compute_logits(self.model(input_ids, positions, batcher.kv_caches, meta))


@pytest.fixture(scope="module", params=sorted(MLA_FAMILIES))
def pair(request, tmp_path_factory):
    return Pair(make_mla_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param))


def test_builds_the_latent_attention_model(pair):
    from gpuworker.models.layers import GatedMLP
    from gpuworker.models.moe import SparseMoE

    assert isinstance(pair.model, DeepseekForCausalLM)
    sparse = pair.mc.moe.sparse_layers if pair.mc.moe is not None else (False,) * pair.mc.num_layers
    assert [isinstance(layer.mlp, SparseMoE if s else GatedMLP) for layer, s in zip(pair.model.layers, sparse)] == [
        True
    ] * len(sparse)
    mla = pair.mc.mla
    assert pair.mc.kv_cache_layout == (1, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)


def test_full_prompt_in_one_prefill(pair):
    logits = pair.run(LatentBatcher(pair.mc), [("s", pair.prompts[300])])
    torch.testing.assert_close(logits, pair.reference(300), **TOLERANCE)


def test_prefix_then_chunks_then_absorbed_decode(pair):
    prompt, reference = pair.prompts[300], pair.reference(300)
    batcher = LatentBatcher(pair.mc, seed=7)
    edges = [0, 37, 48, 130, 250]
    pieces = [pair.run(batcher, [("s", prompt[a:b])]) for a, b in zip(edges, edges[1:])]
    pieces += [pair.run(batcher, [("s", [token])]) for token in prompt[edges[-1] :]]
    logits = torch.cat(pieces)
    torch.testing.assert_close(logits, reference, **TOLERANCE)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_mixed_decodes_and_chunked_prefills_with_padding(pair):
    batcher = LatentBatcher(pair.mc, seed=5)
    pair.run(batcher, [("a", pair.prompts[17][:-1]), ("b", pair.prompts[64][:-1]), ("d", pair.prompts[300][:100])])
    step2 = [
        ("a", pair.prompts[17][-1:]),
        ("b", pair.prompts[64][-1:]),
        ("d", pair.prompts[300][100:]),
        ("e", pair.prompts[5]),
    ]
    num_tokens = 2 + 200 + 5
    logits = pair.run(batcher, step2, pad_to=num_tokens + 3)
    expected = torch.cat(
        [pair.reference(17)[-1:], pair.reference(64)[-1:], pair.reference(300)[100:], pair.reference(5)]
    )
    torch.testing.assert_close(logits[:num_tokens], expected, **TOLERANCE)


def test_triton_decode_path_matches_transformers(pair, monkeypatch):
    """The GPU path's kernels (latent cache write, absorbed MLA decode) on Triton's interpreter."""
    from gpuworker.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pair.model, "attn_backend", TritonAttentionBackend())
    prompt, reference = pair.prompts[64], pair.reference(64)
    batcher = LatentBatcher(pair.mc, seed=9)
    pieces = [pair.run(batcher, [("s", prompt[:40])])]
    pieces += [pair.run(batcher, [("s", [token])]) for token in prompt[40:]]
    torch.testing.assert_close(torch.cat(pieces), reference, **TOLERANCE)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("group_rows", [None, 30], ids=["one-group", "groups-of-30-rows"])
def test_batched_prefill_matches_transformers(pair, monkeypatch, backend, group_rows):
    """The batched prefill (one gather and kv_b_proj per group of sequences; on the triton backend
    the Triton MLA prefill kernel, on the interpreter): a whole prompt, chunks after cached prefixes
    and decodes in one ragged step, against transformers; also with groups cut small (30 context
    rows, so each sequence of the step is a group of its own)."""
    from gpuworker.attention.triton_backend import TritonAttentionBackend
    from gpuworker.models.deepseek import prefill_buffer

    if group_rows is not None:
        mla = pair.mc.mla
        width = pair.mc.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        monkeypatch.setattr(prefill_buffer, "EXPANDED_VALUES_PER_GROUP", group_rows * width)
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(pair.model, "attn_backend", TritonAttentionBackend())
    batcher = LatentBatcher(pair.mc, seed=13)
    pair.run(batcher, [("a", pair.prompts[17][:-1]), ("d", pair.prompts[64][:20])])
    step = [("a", pair.prompts[17][-1:]), ("d", pair.prompts[64][20:]), ("e", pair.prompts[5])]
    logits = pair.run(batcher, step, pad_to=1 + 44 + 5 + 2)
    expected = torch.cat([pair.reference(17)[-1:], pair.reference(64)[20:], pair.reference(5)])
    torch.testing.assert_close(logits[:50], expected, **TOLERANCE)


def test_context_groups_cut_consecutive_sequences_within_the_row_budget():
    from gpuworker.models.deepseek.prefill_buffer import context_groups

    seq_lens = [9, 4, 10, 20, 50, 3, 3]
    assert context_groups(seq_lens, 2, 7, 30) == [(2, 4), (4, 5), (5, 7)]  # a longer one alone
    assert context_groups(seq_lens, 1, 7, 1000) == [(1, 7)]
    assert context_groups(seq_lens, 3, 3, 30) == []
    assert context_groups(seq_lens, 0, 3, 1) == [(0, 1), (1, 2), (2, 3)]


def test_greedy_generation_matches_transformers(pair):
    """Token for token: prefill, then each new token decoded (absorbed) from the latent cache."""
    prompt = pair.prompts[17]
    with torch.no_grad():
        expected = pair.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    batcher = LatentBatcher(pair.mc, seed=11)
    tokens = [int(pair.run(batcher, [("g", prompt)])[-1].argmax())]
    while len(tokens) < 12:
        tokens.append(int(pair.run(batcher, [("g", tokens[-1:])])[-1].argmax()))
    assert tokens == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("num_queries, context_len", [(1, 1), (5, 5), (7, 40)])
def test_fused_prefill_attention_equals_the_reference(num_queries, context_len):
    """The GPU path's prefill attention (torch's fused SDPA) against the float32 reference, on the CPU."""
    from gpuworker.models.deepseek.attention import attend_expanded

    generator = torch.Generator().manual_seed(context_len)
    query = torch.randn(num_queries, 4, 24, generator=generator)
    keys = torch.randn(context_len, 4, 24, generator=generator)
    values = torch.randn(context_len, 4, 16, generator=generator)
    fused = attend_expanded(query, keys, values, 0.2, fused=True)
    torch.testing.assert_close(fused, attend_expanded(query, keys, values, 0.2, fused=False), rtol=1e-5, atol=1e-5)


def test_decode_step_has_no_data_dependent_control_flow(pair, monkeypatch):
    """A decode-only step on the GPU path, run on the meta device (its kernels stood in for by
    shape-only stand-ins): reading any tensor value on the host, which a CUDA graph cannot capture,
    would fail here."""
    from gpuworker.attention.backend import AttentionMetadata
    from gpuworker.kernels.attention import mla_cache_write, mla_decode

    calls = []

    def decode_shape(query, latent_cache, block_tables, seq_lens, scale, kv_lora_rank, max_seq_len, **_):
        calls.append(max_seq_len)
        return query.new_empty(*query.shape[:2], kv_lora_rank)

    monkeypatch.setattr(mla_decode, "mla_decode", decode_shape)
    monkeypatch.setattr(mla_cache_write, "mla_cache_write", lambda *args: None)

    class GraphBackend:
        name = "triton"

    with torch.device("meta"):
        model = DeepseekForCausalLM(pair.mc, GraphBackend())
        planes, heads, width = pair.mc.kv_cache_layout
        caches = [torch.empty(planes, 8, 16, heads, width) for _ in range(pair.mc.num_layers)]
        batch = 3
        meta = AttentionMetadata(
            slot_mapping=torch.empty(batch, dtype=torch.int64),
            query_start_loc=torch.empty(batch + 1, dtype=torch.int32),
            seq_lens=torch.empty(batch, dtype=torch.int32),
            block_tables=torch.empty(batch, 8, dtype=torch.int32),
            num_decode_seqs=batch,
            max_query_len=1,
            max_seq_len=128,
            query_start_loc_cpu=list(range(batch + 1)),
            seq_lens_cpu=[0] * batch,
        )
        ids, positions = torch.empty(batch, dtype=torch.int64), torch.empty(batch, dtype=torch.int64)
        hidden = model(ids, positions, caches, meta)
    assert hidden.shape == (batch, pair.mc.hidden_size)
    assert calls == [128] * pair.mc.num_layers
