"""Start-up sizes that follow from the device and the model: the KV pool, and the batch limits
max_num_seqs and max_num_batched_tokens where the user left them None.

Arithmetic on a few figures only (free device memory, the model's shape), so the rules are tested
with made-up memory sizes; the engine measures the free memory once the weights are loaded and calls
`plan_sizes`. On CUDA:

- max_num_batched_tokens keeps a step's matmul work near that of 8,192 tokens of Llama-3-8B (the
  budget BENCHMARKS.md's throughput figures were measured at), rounded to the nearest power of two:
  well past the point where the GEMMs are compute-bound, and no larger, because the decodes sharing
  a step wait for it. Models within a factor ~1.4 of 8B keep 8,192; smaller ones get more tokens
  (up to 16,384), larger ones fewer (down to 2,048).
- max_num_seqs: as many sequences as the memory left for the pool holds at TOKENS_PER_SEQ tokens
  each (with each one's row of sampling temporaries), at most 1,024, where the CUDA-graph buckets end.
  More would only be admitted to be preempted; fewer leave a large GPU decoding in weight-bound
  batches (BENCHMARKS.md, H200, Llama-3-8B: 512 sequences 11.4k output tok/s offline, 1,024 12.5k).

On CPU the limits stay small and fixed: a CPU step is slow, and there is no device memory to size from.

Each sequence slot also holds a device block-table row for max_model_len tokens (256 KiB at 1M). A
max_model_len the operator set that one sequence could not reach in the pool is refused with the
bytes it needs; one left to the model's default is lowered to the pool by the engine instead.

A vision model's images take device memory beside the KV pool (its encoder's weights are loaded
with the model, so the measured free memory has them already): one vision-encoder call's peak
activations at its most patch rows, and the cache of encoder outputs; both come off the budget
before the pool is sized (`vision_activation_bytes`).

A latent-attention model's prefill expands its groups of sequences' cached latents into per-head
keys and values for the step (models.deepseek.prefill_buffer): room for the largest group a step can
hold comes off the budget too, from the same figures the prefill cuts its groups by.

A model with sliding-window and full layers (Gemma 3) gets a second pool for the sliding ones
(engine.window_blocks), where a sequence holds only the blocks its window can still read, taken as
it grows; the main pool's blocks count the full layers only. The memory is split between the two
pools as a sequence of TOKENS_PER_SEQ tokens uses them (its tokens in the full layers, at most its
window in the sliding ones), so short sequences do not pay for whole windows; the window pool never
gets more than every running sequence's whole window (window_pool_blocks), nor less than one
sequence's window and a step (min_window_pool_blocks). Sequences that outgrow their share are
preempted and recomputed, as when the main pool runs out.
"""

from __future__ import annotations

import math
from dataclasses import replace

from gpuworker.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from gpuworker.models.config import ModelConfig
from gpuworker.models.deepseek.prefill_buffer import prefill_buffer_bytes

CPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_BATCHED_TOKENS = 8192
MIN_NUM_SEQS = 8
MAX_NUM_SEQS = 1024
# The KV tokens a running sequence holds on average over its life in chat-like serving: prompts of
# 100-1024 tokens and answers of 64-512 (the serving benchmark's mix) hold ~700.
TOKENS_PER_SEQ = 768
MIN_NUM_BATCHED_TOKENS = 2048
MAX_NUM_BATCHED_TOKENS = 16384
# The most patch rows one vision-encoder call takes (a step's new images beyond it go in several
# calls); Qwen2.5-VL's largest image at its processor's default max_pixels is exactly this many.
MAX_ENCODER_PATCHES = 1 << 16
# The encoder outputs kept on the device, in image tokens: at least this many, and a step's tokens.
MIN_IMAGE_CACHE_TOKENS = 16384
# Llama-3-8B's decoder-layer weights (32 layers of q, k, v, o and the gated MLP) times 8,192 tokens.
REFERENCE_STEP_WEIGHT_TOKENS = 6_979_321_856 * 8192


def kv_cache_block_bytes(mc: ModelConfig, block_size: int, element_size: int, num_layers: int | None = None) -> int:
    """One block of `num_layers` layers (all of mc's by default), each laid out as mc.kv_cache_layout."""
    layers = mc.num_layers if num_layers is None else num_layers
    planes, heads, width = mc.kv_cache_layout
    return layers * planes * block_size * heads * width * element_size


def pool_window(mc: ModelConfig) -> int | None:
    """The window of mc's sliding layers where some layers slide and some do not (one window for
    all of them), else None: those layers get a pool of their own (engine.window_blocks)."""
    windows = {window for window in mc.layer_windows if window is not None}
    if len(windows) != 1 or None not in mc.layer_windows:
        return None
    return windows.pop()


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most window blocks the running sequences can hold at once: each the blocks of its window
    (one more where it starts mid-block, one for its decode's next block, one for a chunk's end),
    and the step's new tokens."""
    per_seq = -(-(window - 1) // block_size) + 3
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def seq_window_blocks(window: int, block_size: int, seq_tokens: int) -> int:
    """The window blocks a sequence of seq_tokens tokens holds: its tokens up to the window, and
    one more where its window starts mid-block."""
    return -(-min(seq_tokens, window) // block_size) + 1


def min_window_pool_blocks(window: int, block_size: int, max_num_batched_tokens: int) -> int:
    """What one sequence alone may need: the blocks of its window and of one step's chunk."""
    return -(-(window - 1 + max_num_batched_tokens) // block_size) + 2


def token_activation_bytes(mc: ModelConfig, element_size: int) -> int:
    """Rough peak activations per batched token: the widest per-token tensors of a layer."""
    return (4 * mc.hidden_size + 3 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size) * element_size


def image_cache_tokens(max_num_batched_tokens: int) -> int:
    """The image tokens whose encoder output the model runner keeps (engine.multimodal's cache)."""
    return max(max_num_batched_tokens, MIN_IMAGE_CACHE_TOKENS)


def vision_activation_bytes(mc: ModelConfig, element_size: int, max_num_batched_tokens: int) -> int:
    """Device memory a vision model's images take beside the KV pool (0 for a text-only model):
    one encoder call over MAX_ENCODER_PATCHES patch rows, each row at the widest tensors of a block
    (residual, norm with its float32 copy, q/k/v, attention output: ~8 widths; the MLP's gate, up
    and product: 3 intermediate) with its float32 pixels and their cast, attention fused (no score
    matrix); and the encoder-output cache at image_cache_tokens rows of the text width."""
    vision = mc.vision
    if vision is None:
        return 0
    row = (8 * vision.hidden_size + 3 * vision.intermediate_size) * element_size + vision.patch_values * (
        4 + element_size
    )
    cache = image_cache_tokens(max_num_batched_tokens) * mc.hidden_size * element_size
    return MAX_ENCODER_PATCHES * row + cache


def mla_prefill_bytes(
    mc: ModelConfig,
    *,
    element_size: int,
    kv_element_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """A latent-attention prefill step's largest transient group of expanded keys and values (0 for
    other models); mc is the rank's shapes (its share of the heads)."""
    if mc.mla is None:
        return 0
    return prefill_buffer_bytes(
        mc.mla,
        mc.num_heads,
        element_size=element_size,
        cache_element_size=kv_element_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


def seq_activation_bytes(mc: ModelConfig) -> int:
    """Per sequence of a step: float32 logits and the sampler's temporaries of the same size."""
    return mc.vocab_size * 4 * 6


def decoder_layer_weights(mc: ModelConfig) -> int:
    """Weights every token multiplies through: q, k, v, o and the gated MLP of each layer."""
    if mc.mla is not None:
        return mc.num_layers * (_latent_attention_weights(mc) + 3 * mc.hidden_size * mc.intermediate_size)
    per_layer = (
        2 * mc.hidden_size * mc.q_size + 2 * mc.hidden_size * mc.kv_size + 3 * mc.hidden_size * mc.intermediate_size
    )
    return mc.num_layers * per_layer


def _latent_attention_weights(mc: ModelConfig) -> int:
    """One layer's latent attention projections: q (direct or through q_lora_rank), the latent and
    rotary key, their expansion into per-head keys and values, and o."""
    mla, hidden, heads = mc.mla, mc.hidden_size, mc.num_heads
    q_size = heads * mla.qk_head_dim
    q = hidden * q_size if mla.q_lora_rank is None else mla.q_lora_rank * (hidden + q_size)
    kv = hidden * mla.cache_width + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    return q + kv + heads * mla.v_head_dim * hidden


def default_max_num_batched_tokens(mc: ModelConfig) -> int:
    """The CUDA token budget for this model (see the module's docstring)."""
    tokens = REFERENCE_STEP_WEIGHT_TOKENS / decoder_layer_weights(mc)
    return min(MAX_NUM_BATCHED_TOKENS, max(MIN_NUM_BATCHED_TOKENS, 1 << round(math.log2(tokens))))


def plan_sizes(
    config: EngineConfig,
    mc: ModelConfig,
    *,
    element_size: int,
    max_model_len: int,
    free_device_bytes: int | None,
    kv_element_size: int | None = None,
) -> EngineConfig:
    """config with num_kv_blocks, max_num_seqs and max_num_batched_tokens filled in where None;
    given values are kept. element_size: bytes per activation value; kv_element_size: per cached
    key or value (None: element_size; 1 for an FP8 cache). free_device_bytes: device memory free
    after loading the weights (None: the CPU, whose pool takes kv_cache_memory_bytes).

    A model with sliding and full layers (pool_window) also gets sliding_window and
    num_window_kv_blocks (unless that is 0): the window pool is set aside first, and the main
    pool's blocks hold the full layers only."""
    kv_size = kv_element_size or element_size
    window = pool_window(mc) if config.num_window_kv_blocks != 0 else None
    full_layers = mc.num_layers if window is None else sum(1 for w in mc.layer_windows if w is None)
    block_bytes = kv_cache_block_bytes(mc, config.block_size, kv_size, full_layers)
    window_block_bytes = kv_cache_block_bytes(mc, config.block_size, kv_size, mc.num_layers - full_layers)
    max_num_seqs = config.max_num_seqs
    if free_device_bytes is None:
        max_num_batched_tokens = config.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS
        max_num_seqs = max_num_seqs or CPU_MAX_NUM_SEQS
        budget = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        source = f"kv_cache_memory_bytes ({budget})"
        per_seq_bytes = 0
    else:
        # Room for a decode of every sequence in one step.
        max_num_batched_tokens = config.max_num_batched_tokens or max(
            default_max_num_batched_tokens(mc), max_num_seqs or 0
        )
        budget = (
            int(free_device_bytes * config.gpu_memory_utilization)
            - max_num_batched_tokens * token_activation_bytes(mc, element_size)
            - vision_activation_bytes(mc, element_size, max_num_batched_tokens)
            - mla_prefill_bytes(
                mc,
                element_size=element_size,
                kv_element_size=kv_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs or MAX_NUM_SEQS,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        )
        source = f"gpu_memory_utilization ({config.gpu_memory_utilization}) of {free_device_bytes} free bytes"
        per_seq_bytes = seq_activation_bytes(mc) + block_table_row_bytes(max_model_len, config.block_size)
        if max_num_seqs is None:
            seq_tokens = min(TOKENS_PER_SEQ, max_model_len)
            # Each sequence's share of the window pool, if any.
            window_share = (
                seq_window_blocks(window, config.block_size, seq_tokens) * window_block_bytes if window else 0
            )
            if config.num_kv_blocks is not None:
                fit = config.num_kv_blocks * config.block_size // seq_tokens
            else:
                fit = budget // (seq_tokens * block_bytes // config.block_size + per_seq_bytes + window_share)
            max_num_seqs = min(MAX_NUM_SEQS, max(MIN_NUM_SEQS, fit))
    share = None
    if window is not None and config.num_kv_blocks is None and config.num_window_kv_blocks is None:
        seq_tokens = min(TOKENS_PER_SEQ, max_model_len)
        share = _window_share_blocks(
            budget - max_num_seqs * per_seq_bytes,
            seq_tokens * block_bytes // config.block_size,
            seq_window_blocks(window, config.block_size, seq_tokens),
            window_block_bytes,
        )
    num_window_blocks = _num_window_blocks(config, window, max_num_seqs, max_num_batched_tokens, share)
    budget -= num_window_blocks * window_block_bytes
    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = (budget - max_num_seqs * per_seq_bytes) // block_bytes
        if num_kv_blocks < 1:
            raise ValueError(f"{source} leaves no room for one KV block of {block_bytes} bytes")
        _require_context(config, num_kv_blocks, block_bytes, source)
        # More than every sequence at full length could ever use is wasted memory.
        num_kv_blocks = min(num_kv_blocks, max_num_seqs * -(-max_model_len // config.block_size))
        if share is not None:  # what the main pool cannot use goes to the windows
            spare = (budget - max_num_seqs * per_seq_bytes - num_kv_blocks * block_bytes) // window_block_bytes
            most = window_pool_blocks(window, config.block_size, max_num_seqs, max_num_batched_tokens)
            num_window_blocks = max(num_window_blocks, min(most, num_window_blocks + spare))
    return replace(
        config,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_window_kv_blocks=num_window_blocks,
        sliding_window=window,
        num_host_kv_blocks=_num_host_blocks(config, block_bytes, window),
    )


def _num_host_blocks(config: EngineConfig, block_bytes: int, window: int | None) -> int:
    """The host tier's blocks in host_kv_cache_bytes (a block there holds what one holds in the pool)."""
    if not config.host_kv_cache_bytes:
        return 0
    if window is not None:
        raise ValueError("host_kv_cache_bytes is not supported for a model with a sliding-window KV pool")
    if config.host_kv_cache_bytes < block_bytes:
        raise ValueError(
            f"host_kv_cache_bytes ({config.host_kv_cache_bytes}) cannot hold one KV block of {block_bytes} bytes"
        )
    return config.host_kv_cache_bytes // block_bytes


def block_table_row_bytes(max_model_len: int, block_size: int) -> int:
    """A sequence slot's device block-table row (int32 block ids for max_model_len tokens): the
    decode CUDA graphs hold one per sequence of their largest batch, 256 KiB at 1M tokens."""
    return -(-max_model_len // block_size) * 4


def _require_context(config: EngineConfig, num_kv_blocks: int, block_bytes: int, source: str) -> None:
    """Refuse a max_model_len the operator set that one sequence could not reach in the pool the
    memory holds (a default one is lowered to the pool by the engine instead)."""
    wanted = config.max_model_len
    if wanted is None or num_kv_blocks * config.block_size >= wanted:
        return
    need = -(-wanted // config.block_size) * block_bytes
    raise ValueError(
        f"max_model_len ({wanted}) needs {need / 2**30:.1f} GiB of KV cache for one sequence, but "
        f"{source} leaves room for {num_kv_blocks * config.block_size} tokens "
        f"({num_kv_blocks * block_bytes / 2**30:.1f} GiB); lower max_model_len, use kv_cache_dtype 'fp8' "
        "or give the pool more memory"
    )


def _window_share_blocks(budget: int, seq_full_bytes: int, seq_window_blocks: int, window_block_bytes: int) -> int:
    """The window pool's blocks in its share of budget: the part a sequence spends on its window
    (seq_window_blocks) beside its tokens in the full layers (seq_full_bytes)."""
    seq_window_bytes = seq_window_blocks * window_block_bytes
    return max(0, budget) * seq_window_bytes // (seq_full_bytes + seq_window_bytes) // window_block_bytes


def _num_window_blocks(
    config: EngineConfig, window: int | None, max_num_seqs: int, max_num_batched_tokens: int, share: int | None
) -> int:
    """The window pool's blocks: the config's, else its share of the memory (None: no share, the
    main pool's size was given) up to window_pool_blocks; 0 without a window pool."""
    if window is None:
        return 0
    least = min_window_pool_blocks(window, config.block_size, max_num_batched_tokens)
    blocks = config.num_window_kv_blocks
    if blocks is None:
        most = window_pool_blocks(window, config.block_size, max_num_seqs, max_num_batched_tokens)
        return max(least, most if share is None else min(share, most))
    if blocks < least:
        raise ValueError(
            f"num_window_kv_blocks ({blocks}) cannot hold one sequence's window ({window} tokens) and a "
            f"step of max_num_batched_tokens ({max_num_batched_tokens}): it needs at least {least}"
        )
    return blocks
