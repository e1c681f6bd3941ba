"""The transient memory of a batched latent-attention prefill, in one place for the prefill that
allocates it (models.deepseek.attention) and the start-up sizing that leaves room for it beside the
KV pool (engine.sizing), so the two cannot drift.

A prefill step cuts its sequences into groups (`context_groups`): consecutive sequences whose
context rows together stay within `group_rows`, or one longer sequence alone. Per group it holds
each context row's cache slot (int64), the row gathered from the latent cache (widened to the model
dtype where the cache is FP8) and its expansion by kv_b_proj into per-head keys and values; the
Triton prefill kernel writes into the step's output and allocates nothing more. The GEMM's own
workspace and the CUDA allocator's rounding are left to gpu_memory_utilization's margin.
"""

from __future__ import annotations

from gpuworker.models.deepseek.config import MLAConfig

# A group's expanded keys and values (rows x heads x (nope + v)) at most: 2^28 values, 512 MiB in bf16
# (DeepSeek-V3's 128 heads: 8,192 context rows a group; V2-Lite's 16: 65,536), so a step of many
# long contexts does not hold all of them expanded at once.
EXPANDED_VALUES_PER_GROUP = 1 << 28
SLOT_BYTES = 8  # a context row's int64 cache slot, alive for the whole group
SEQ_BYTES = 12  # a sequence's cu_seqlens_k entry (int32) and its int64 cumulative sum
FLOAT32_BYTES = 4


def expanded_width(mla: MLAConfig, num_heads: int) -> int:
    """Values of one context row's expanded keys and values (the rope key stays shared)."""
    return num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)


def group_rows(mla: MLAConfig, num_heads: int) -> int:
    """The most context rows one group packs together (a longer sequence is a group alone)."""
    return max(1, EXPANDED_VALUES_PER_GROUP // expanded_width(mla, num_heads))


def context_groups(seq_lens: list[int], first: int, last: int, max_rows: int) -> list[tuple[int, int]]:
    """Sequences first..last-1 (host context lengths seq_lens) cut into runs of consecutive ones
    [(begin, end), ...] of at most max_rows context rows together; a longer sequence is a run alone."""
    groups, begin, rows = [], first, 0
    for i in range(first, last):
        if rows and rows + seq_lens[i] > max_rows:
            groups.append((begin, i))
            begin, rows = i, 0
        rows += seq_lens[i]
    if last > begin:
        groups.append((begin, last))
    return groups


def row_bytes(mla: MLAConfig, num_heads: int, element_size: int, cache_element_size: int) -> int:
    """The peak bytes a group holds per context row: its slot, and the larger of two moments. An
    FP8 cache's rows are widened through float32 (gathered, float32, scaled, then the model dtype:
    at most two float32 copies beside the gathered row); then the gathered rows in the model dtype
    and their expansion by kv_b_proj."""
    width = mla.cache_width
    widen = width * (cache_element_size + 2 * FLOAT32_BYTES) if cache_element_size != element_size else 0
    expand = (width + expanded_width(mla, num_heads)) * element_size
    return SLOT_BYTES + max(widen, expand)


def largest_group_rows(
    mla: MLAConfig, num_heads: int, *, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """The most context rows one group of a step can hold: a full group, or one sequence at
    max_model_len alone (a chunk's context counts its earlier chunks and prefix hits, so a step's
    token budget does not bound it); never more than every prefill of the step at max_model_len."""
    max_prefills = min(max_num_seqs, max_num_batched_tokens)
    return min(max(group_rows(mla, num_heads), max_model_len), max_prefills * max_model_len)


def prefill_buffer_bytes(
    mla: MLAConfig,
    num_heads: int,
    *,
    element_size: int,
    cache_element_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """The most transient memory one prefill step's group can take (the room sizing leaves)."""
    max_prefills = min(max_num_seqs, max_num_batched_tokens)
    rows = largest_group_rows(
        mla,
        num_heads,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return rows * row_bytes(mla, num_heads, element_size, cache_element_size) + (max_prefills + 1) * SEQ_BYTES
