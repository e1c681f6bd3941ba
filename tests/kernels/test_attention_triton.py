"""TritonAttentionBackend against TorchAttentionBackend over steps mixing prefill chunks, decodes and padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.attention.triton_backend import TritonAttentionBackend

ON_CUDA = torch.cuda.is_available()
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = (32, 8, 128) if ON_CUDA else (4, 2, 32)
BLOCK_SIZE = 16


class _Sequences:
    """Hands out blocks to sequences and builds the metadata of one step, as the model runner does."""

    def __init__(self, num_blocks: int, device: str) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 stays unused
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.device = device

    def step(self, chunks: list[tuple[str, int]], padding: int = 0) -> AttentionMetadata:
        slots, qsl, seq_lens, tables = [], [0], [], []
        for name, num_new in chunks:
            start = self.lengths.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK_SIZE < start + num_new:
                table.append(self.free.pop())
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + num_new)]
            self.lengths[name] = start + num_new
            qsl.append(qsl[-1] + num_new)
            seq_lens.append(start + num_new)
            tables.append(table)
        slots += [-1] * padding
        num_decode = 0
        while num_decode < len(chunks) and chunks[num_decode][1] == 1 and seq_lens[num_decode] > 1:
            num_decode += 1
        width = max(len(t) for t in tables)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        return AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            query_start_loc=tensor(qsl, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            num_decode_seqs=num_decode,
            max_query_len=max(n for _, n in chunks),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )


SMALL_STEPS = [
    ([("a", 40), ("b", 5), ("c", 1)], 0),  # fresh prompts; b is chunked
    ([("a", 1), ("c", 1), ("b", 2), ("d", 9)], 3),  # decodes first, then prefill, then padding rows
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], 2),  # pure decode, padded as for a CUDA graph
]
REAL_STEPS = [
    ([("a", 1500), ("b", 512), ("c", 1)], 0),
    ([("a", 1), ("c", 1), ("b", 512), ("d", 300)], 5),
    ([("a", 1), ("b", 1), ("c", 1), ("d", 1)], 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_torch_backend_step_by_step(dtype, device, generator, tolerance):
    steps = REAL_STEPS if ON_CUDA else SMALL_STEPS
    num_blocks = 300 if ON_CUDA else 16
    sequences = _Sequences(num_blocks, device)
    triton_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    triton_cache = triton_cache.to(dtype).to(device)
    torch_cache = triton_cache.clone()
    scale = HEAD_DIM**-0.5
    for chunks, padding in steps:
        meta = sequences.step(chunks, padding)
        num_tokens = meta.query_start_loc_cpu[-1] + padding
        query = torch.randn(num_tokens, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype).to(device)

        got = TritonAttentionBackend().forward(query, key, value, triton_cache, meta, scale)
        expected = TorchAttentionBackend().forward(query, key, value, torch_cache, meta, scale)

        torch.testing.assert_close(triton_cache, torch_cache, atol=0, rtol=0)
        torch.testing.assert_close(got, expected, **tolerance(dtype))
        if padding:
            assert torch.equal(got[-padding:], torch.zeros_like(got[-padding:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_with_rotary_matches_rotary_then_torch_backend(dtype, device, generator, tolerance):
    # The model's path on the Triton backend: forward_with_rotary gets unrotated q and k (strided
    # slices of a fused qkv); the decode kernel rotates and caches the decode rows' tokens in its
    # launch, the rotary kernel those of the prefill rows. Against the rotary kernel alone + the torch
    # backend's forward, step by step over prefills, decodes and padding: the cache bit for bit.
    from gpuworker.attention.backend import fuses_rotary_and_cache_write
    from gpuworker.kernels.attention.rotary import apply_rotary
    from gpuworker.models.layers import RotaryEmbedding

    backend = TritonAttentionBackend()
    assert fuses_rotary_and_cache_write(backend) and not fuses_rotary_and_cache_write(TorchAttentionBackend())
    steps = REAL_STEPS if ON_CUDA else SMALL_STEPS
    num_blocks = 300 if ON_CUDA else 16
    sequences = _Sequences(num_blocks, device)
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None).to(device)
    triton_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    triton_cache = triton_cache.to(dtype).to(device)
    torch_cache = triton_cache.clone()
    q_size, kv_size = NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    scale = HEAD_DIM**-0.5
    for chunks, padding in steps:
        meta = sequences.step(chunks, padding)
        num_tokens = meta.query_start_loc_cpu[-1] + padding
        positions = torch.cat(
            [torch.arange(n - q, n) for n, (_, q) in zip(meta.seq_lens_cpu, chunks)]
            + [torch.zeros(padding, dtype=torch.int64)]
        ).to(device)
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype).to(device)
        query = qkv[:, :q_size].view(num_tokens, NUM_Q_HEADS, HEAD_DIM)
        key = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        value = qkv[:, q_size + kv_size :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        ref_query, ref_key = apply_rotary(positions, query.clone(), key.clone(), rotary.cos_cache, rotary.sin_cache)
        expected = TorchAttentionBackend().forward(ref_query, ref_key, value.clone(), torch_cache, meta, scale)

        key_before, value_before = key.clone(), value.clone()
        got = backend.forward_with_rotary(
            positions, query, key, value, triton_cache, meta, scale, rotary.cos_cache, rotary.sin_cache
        )

        # Values bit for bit; keys within one rounding: the decode kernel's rotary may round one
        # product differently from the rotary kernel's (an FMA kept or not; ~2% of bf16 keys by an ulp).
        assert torch.equal(triton_cache[1], torch_cache[1])
        close = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else tolerance(dtype)
        torch.testing.assert_close(triton_cache[0], torch_cache[0], **close)
        assert torch.equal(key, key_before) and torch.equal(value, value_before)
        torch.testing.assert_close(got, expected, **tolerance(dtype))
        if padding:
            assert torch.equal(got[-padding:], torch.zeros_like(got[-padding:]))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3-moe", "glm4-moe-grouped"])
def test_model_on_triton_backend_matches_torch_backend(family, tmp_path, device):
    # Attention.forward takes the fused path for the Triton backend (qwen3: the q/k norms inside the
    # rotary launches, so the norm modules never run; GLM: rotary over the first half of each head,
    # after the norm modules, as the launches norm whole heads only) and the unfused one for the torch
    # backend (on the CPU); the logits of a prefill and of padded decodes agree, and so do the caches.
    from gpuworker.models.loader import load_model, load_model_config
    from tests.gpuworker.checkpoints import make_checkpoint
    from tests.gpuworker.models.paged_batch import PagedBatcher

    mc = load_model_config(make_checkpoint(tmp_path, family))
    devices = {"triton": device, "torch": "cpu"}
    models = {
        backend.name: load_model(mc, device=devices[backend.name], dtype=torch.float32, attn_backend=backend)
        for backend in (TritonAttentionBackend(), TorchAttentionBackend())
    }
    batchers = {name: PagedBatcher(mc) for name in models}
    batchers["triton"].kv_caches = [cache.to(device) for cache in batchers["triton"].kv_caches]
    qk_norms = [module for name, module in models["triton"].named_modules() if name.endswith(("q_norm", "k_norm"))]
    assert len(qk_norms) == (2 * mc.num_layers if mc.qk_norm else 0)
    norm_calls = []
    for module in qk_norms:
        module.register_forward_hook(lambda *_: norm_calls.append(1))
    steps = [
        ([("a", list(range(3, 40))), ("b", list(range(50, 55)))], None),
        ([("a", [7]), ("b", [8])], 4),
        ([("a", [9]), ("b", [10])], 3),
    ]
    for chunks, pad_to in steps:
        logits = {}
        for name, model in models.items():
            input_ids, positions, meta = batchers[name].batch(chunks, pad_to=pad_to)
            meta = dataclasses.replace(
                meta,
                **{
                    field.name: getattr(meta, field.name).to(devices[name])
                    for field in dataclasses.fields(meta)
                    if isinstance(getattr(meta, field.name), torch.Tensor)
                },
            )
            with torch.no_grad():
                hidden = model(input_ids.to(devices[name]), positions.to(devices[name]), batchers[name].kv_caches, meta)
                logits[name] = model.compute_logits(hidden).cpu()
        torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    assert (norm_calls == []) == (mc.rotary_dim is None)
    for triton_cache, torch_cache in zip(batchers["triton"].kv_caches, batchers["torch"].kv_caches, strict=True):
        torch.testing.assert_close(triton_cache.cpu(), torch_cache, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["forward", "forward_with_rotary"])
def test_fp8_cache_matches_torch_backend(fused, device, generator, tolerance):
    # Both backends on an FP8 cache with per-layer scales, step by step over prefills, decodes and
    # padding: the same cache (float32 activations, whose rotations agree bit for bit in the
    # interpreter) and the same attention, to float32's tolerance; on a GPU the fused rotation may
    # round a key an ulp differently (see above), which can move it one e4m3 step.
    from gpuworker.kernels.attention.rotary import apply_rotary
    from gpuworker.kernels.quant.kv_cache import FP8_DTYPE
    from gpuworker.models.layers import RotaryEmbedding

    scales = {"k_scale": 0.05, "v_scale": 0.1}
    steps = REAL_STEPS if ON_CUDA else SMALL_STEPS
    num_blocks = 300 if ON_CUDA else 16
    sequences = _Sequences(num_blocks, device)
    rotary = RotaryEmbedding(HEAD_DIM, 4096, 10000.0, None).to(device)
    triton_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device)
    torch_cache = triton_cache.clone()
    scale = HEAD_DIM**-0.5
    backend = TritonAttentionBackend()
    for chunks, padding in steps:
        meta = sequences.step(chunks, padding)
        num_tokens = meta.query_start_loc_cpu[-1] + padding
        positions = torch.cat(
            [torch.arange(n - q, n) for n, (_, q) in zip(meta.seq_lens_cpu, chunks)]
            + [torch.zeros(padding, dtype=torch.int64)]
        ).to(device)
        query, key, value = (
            torch.randn(num_tokens, heads, HEAD_DIM, generator=generator).to(device)
            for heads in (NUM_Q_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
        )
        ref_query, ref_key = apply_rotary(positions, query.clone(), key.clone(), rotary.cos_cache, rotary.sin_cache)
        expected = TorchAttentionBackend().forward(ref_query, ref_key, value, torch_cache, meta, scale, **scales)
        if fused:
            got = backend.forward_with_rotary(
                positions, query, key, value, triton_cache, meta, scale, rotary.cos_cache, rotary.sin_cache, **scales
            )
        else:
            got = backend.forward(ref_query, ref_key, value, triton_cache, meta, scale, **scales)

        assert torch.equal(triton_cache[1].float(), torch_cache[1].float())
        if ON_CUDA and fused:
            assert (triton_cache[0].float() != torch_cache[0].float()).float().mean() < 0.01
            torch.testing.assert_close(got, expected, atol=0.05, rtol=0.05)
        else:
            assert torch.equal(triton_cache[0].float(), torch_cache[0].float())
            torch.testing.assert_close(got, expected, **tolerance(torch.float32))
        assert torch.equal(got[num_tokens - padding :], torch.zeros_like(got[num_tokens - padding :]))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_on_fp8_cache_matches_torch_backend(family, tmp_path, device):
    # The whole engine on an FP8 cache, through the Triton kernels (decode rows rotated and cached
    # in the attention launch, prefill rows by the rotary kernel, qwen3's q/k norms inside both;
    # CUDA graphs on a GPU, after a warm-up that compiles those launches) and through the CPU's
    # torch backend: the same greedy tokens, and again on a second pass whose prompts start from
    # FP8 blocks in the prefix cache.
    from gpuworker.engine import LLMEngine, SamplingParams
    from tests.gpuworker.checkpoints import TINY, make_checkpoint
    from tests.gpuworker.engine.reference import random_prompts

    path = make_checkpoint(tmp_path, family)
    config = dict(dtype="float32", num_kv_blocks=64, max_model_len=128, kv_cache_dtype="fp8")
    prompts = random_prompts((3, 21, 40), TINY["vocab_size"], seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [out.token_ids for out in LLMEngine(path, device="cpu", **config).generate(prompts, greedy)]
    engine = LLMEngine(path, device=device, attn_backend=TritonAttentionBackend(), **config)
    assert [out.token_ids for out in engine.generate(prompts, greedy)] == expected
    second = engine.generate(prompts, greedy)
    assert [out.num_cached_tokens for out in second] == [0, 16, 32]
    assert [out.token_ids for out in second] == expected
