"""One token per row from float logits in one launch, without sorting the vocabulary: temperature,
top-k, top-p, min-p and a seeded Gumbel draw; greedy rows (temperature 0) take the argmax.

What is drawn (sample_reference below computes the same with a full sort):
- x = logits / temperature. A greedy row takes the argmax of its logits, the first index on ties.
- top-k keeps every token whose x is at least the row's k-th largest (tokens tied with it all stay,
  as in transformers' TopKLogitsWarper); top-p then keeps, of what top-k left (renormalised), each
  token whose strictly more likely tokens hold less than top_p of the mass (ties again stay
  together); min-p keeps the tokens whose probability is at least min_p times the largest.
- The draw is the Gumbel-max trick: argmax over the kept tokens of x - log(-log U), where U comes
  from Philox-4x32-10 keyed by the row's 64-bit seed at counter (token id, 0, 0, 0). A row's noise
  depends on its seed alone, not on the batch, and is the same in the kernel and the reference.

How the kernel avoids the sort: each filter keeps the tokens whose x is at least a threshold. The
top-k, then the top-p, threshold is found by narrowing an interval of float keys (the bits of x as
integers in value order): each pass over the row counts the tokens and sums exp(x - max) above NT
thresholds (8 by default) inside the interval, keeps the sub-interval where the filter's test flips,
and stops when the interval holds at most one distinct value (which is then kept). A pass shrinks
the interval (NT + 1)-fold: the first (SamplingConfig.value_passes) space their thresholds by value
(a key interval that crosses zero holds most of its keys in tiny values no token has), the others by
key, which bounds a search to SamplingConfig.max_passes passes. Once the interval holds at most half
SamplingConfig.list_capacity tokens, the pass over the row also appends their keys to per-lane
columns of a list, and the search's later passes read that list instead of the row. Flat top-p 0.95
rows at Llama-3's vocabulary (a random-weight model's) take ~8 search passes, of which the first 3-4
read the row (n inside per pass in a replica of the search: 128k, 50k, 20k, 2k, 241, 21, 3, 1);
top-k 200 reads it twice (128k, 471, ...): ~6 reads of the row where reading it every pass takes ~10.

Rows without top-k mostly skip the search: they draw first and check after. The stats pass (max,
sum) also draws a candidate c, the argmax over every token of x + noise. The kept tokens are a
subset of every token, so if the filters keep c it is the reference's token (first index on ties
too). Min-p's test needs the max alone; top-p's takes one more pass, summing the mass of the tokens
strictly above x_c. A rejected c rules out every token at or below it (they have as much mass above
them, or a smaller probability), so the row draws again among the tokens above c (with min-p), and
checks again. The mass above a candidate drawn from the distribution is about uniform in [0, the row's mass], so
top-p 0.95 keeps the first one ~95% of the time: two reads of the row instead of ~8 passes. After
SamplingConfig.max_draws top-p checks fail, the row searches top-p's threshold above the last
rejected candidate, as above. Top-k rows search (a top-k 200 candidate would almost never be kept),
and so does every row when num_kept is asked for (counting the kept tokens takes the threshold).

A row is split over several programs when the batch is small (one row would otherwise run on one
SM): the programs of a row exchange per-pass partial sums through a scratch buffer and wait for
each other at a counter after every pass. That needs every program of the launch resident at once,
so rows x splits stays within what the SMs hold (one program each until a compiled variant's
occupancy is known); the interpreter runs programs one after another, so it uses one program per
row. Block sizes, thresholds, warps and splitting are a SamplingConfig, tuned per batch size
(bench/sampling.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.device import prefetch
from gpuworker.kernels.launch import check_operand, check_tensor, interpreting, lazy_jit

# A program's partial record per pass: a sum per threshold and seven scalars.
RECORD_WIDTH = 32
MAX_THRESHOLDS = 16  # the largest power of two that leaves the scalars room
MAX_SPLITS = 64


@dataclass(frozen=True)
class SamplingConfig:
    """How the kernel is launched; what it draws does not depend on any of these.

    block: logits per program per loop step of the stats and draw passes. search_block: the same for
    search passes, which hold a [search_block, num_thresholds] tile of sums in registers.
    num_thresholds: a search pass costs compute in proportion and shrinks the interval
    (num_thresholds + 1)-fold. value_passes: search passes whose thresholds are even in value (then
    even in key). list_capacity: once a search's interval holds at most half this many tokens, a
    pass lists their keys (per program, 4 bytes each: rows x programs x list_capacity in all) and
    the search's later passes read the list instead of the row; 0: never. prefetch: how many blocks
    ahead of the one being reduced are loaded, their loads in flight meanwhile (a program is
    latency-bound on its loads otherwise; each costs a register per element). programs_per_sm: rows
    are split until rows x programs per row reaches this many programs per SM, or as many as the
    compiled kernel's registers and shared memory let reside at once, whichever is fewer (a row's
    programs wait for each other). num_warps: per program. max_registers: the compiler's limit per
    thread (ptx .maxnreg; None: its own choice, ~120-240 here, which lets only one or two programs
    reside per SM): fewer registers let more programs reside, at the cost of spills. max_draws: a
    row without top-k draws a candidate with its stats pass and checks it against top-p; after this
    many candidates fail it searches top-p's threshold instead (0: every row searches, as before)."""

    block: int = 1024
    search_block: int = 256
    num_thresholds: int = 8
    value_passes: int = 1
    num_warps: int = 8
    prefetch: int = 1
    programs_per_sm: int = 1
    list_capacity: int = 16384
    max_registers: int | None = None
    max_draws: int = 3

    def __post_init__(self) -> None:
        for field, value, low, high in (("block", self.block, 16, 1 << 16),
                                        ("search_block", self.search_block, 16, 1 << 16),
                                        ("num_thresholds", self.num_thresholds, 2, MAX_THRESHOLDS),
                                        ("num_warps", self.num_warps, 1, 32)):
            if not low <= value <= high or value & (value - 1):
                raise ValueError(f"SamplingConfig.{field} must be a power of two in [{low}, {high}], got {value}")
        if not 0 <= self.prefetch <= 3:
            raise ValueError(f"SamplingConfig.prefetch must be in [0, 3], got {self.prefetch}")
        if not 0 <= self.value_passes <= 8:
            raise ValueError(f"SamplingConfig.value_passes must be in [0, 8], got {self.value_passes}")
        if not 0 <= self.list_capacity <= 1 << 20 or self.list_capacity % self.search_block:
            raise ValueError(f"SamplingConfig.list_capacity must be a multiple of search_block "
                             f"({self.search_block}) in [0, {1 << 20}], got {self.list_capacity}")
        if self.max_registers is not None and not 32 <= self.max_registers <= 255:
            raise ValueError(f"SamplingConfig.max_registers must be None or in [32, 255], got {self.max_registers}")
        if not 0 <= self.max_draws <= 16:
            raise ValueError(f"SamplingConfig.max_draws must be in [0, 16], got {self.max_draws}")
        if not 1 <= self.programs_per_sm <= 32:
            raise ValueError(f"SamplingConfig.programs_per_sm must be in [1, 32], got {self.programs_per_sm}")

    @property
    def max_passes(self) -> int:
        """Passes a search may take: its value passes, then key passes that shrink a float32 key
        interval (at most 2**32 keys) (num_thresholds + 1)-fold each until one key is left."""
        return self.value_passes + math.ceil(32 / math.log2(self.num_thresholds + 1)) + 1

    @property
    def name(self) -> str:
        return (f"b{self.block}-s{self.search_block}-t{self.num_thresholds}-v{self.value_passes}-w{self.num_warps}"
                f"-f{self.prefetch}-p{self.programs_per_sm}-l{self.list_capacity}"
                f"{'' if self.max_registers is None else f'-r{self.max_registers}'}-d{self.max_draws}")


# The kernel in its plainest form (one value pass, every pass over the whole row, every row searching
# its thresholds): the benchmark's baseline.
BASELINE_CONFIG = SamplingConfig(block=2048, search_block=1024, prefetch=0, list_capacity=0, max_draws=0)
# Compiled for sm_90 (Triton 3.9, offline; cuobjdump --dump-resource-usage): the baseline holds
# 180-187 registers a thread, so one program of 8 warps resides per SM (132 of a batch's 512 rows
# at a time, 8 warps an SM); this one, left to ptxas, 157 (the stats pass also draws), so one;
# limited to 128 it spills nothing, and two reside.
DEFAULT_CONFIG = SamplingConfig(max_registers=128)
# The configs measured on each device: configs/sample/<device>.json, {(batch bucket,): SamplingConfig
# fields} from bench/sampling.py (the fastest total over modes and logits kinds); a batch takes the
# smallest bucket holding it (the largest beyond), and DEFAULT_CONFIG on a device without a file.
TABLE_KEY = ("rows",)

# Philox-4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10

# Round kinds of the kernel's state machine.
_STATS, _TOP_K, _TOP_P, _DRAW, _DONE, _CHECK = 0, 1, 2, 3, 4, 5


def _sample_kernel(
    logits_ptr, stride_logits,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr,
    token_ids_ptr, num_kept_ptr, num_passes_ptr, part_f_ptr, part_i_ptr, counter_ptr, list_ptr,
    vocab_size, chunk,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, NT: tl.constexpr, WIDTH: tl.constexpr, SPLITS_P2: tl.constexpr,
    VALUE_PASSES: tl.constexpr, MAX_PASSES: tl.constexpr, PREFETCH: tl.constexpr, LIST_CAP: tl.constexpr,
    HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, MAX_DRAWS: tl.constexpr,
    WRITE_NUM_KEPT: tl.constexpr, WRITE_NUM_PASSES: tl.constexpr,
):
    # A row's programs are consecutive in launch order (axis 0 varies fastest).
    row = tl.program_id(1).to(tl.int64)
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    row_ptr = logits_ptr + row * stride_logits
    begin = split * chunk
    end = tl.minimum(begin + chunk, vocab_size)
    # This program's list of candidate keys (the row's tokens inside the search interval, its part).
    list_base = list_ptr + (row * splits + split) * LIST_CAP
    cols = tl.arange(0, BLOCK)
    thr_ids = tl.arange(0, NT)
    split_ids = tl.arange(0, SPLITS_P2)
    split_mask = split_ids < splits
    INT_MAX: tl.constexpr = 2147483647
    INT_MIN: tl.constexpr = -2147483648

    temperature = tl.load(temperature_ptr + row)
    greedy = temperature <= 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    top_k = INT_MAX  # off: never below the number of finite logits
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row).to(tl.int32)
    top_p = 1.0
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + row)
    min_p = 0.0
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)

    # Row state, the same in every program of the row (each reduces the same partials in one order).
    kind = 0  # _STATS
    rounds = 0  # passes done so far (and barriers passed)
    passes = 0  # passes of the current search
    row_max = float("-inf")
    token = 0
    tau = INT_MIN  # the smallest kept key
    num_finite = 0
    z_dom = 0.0  # the mass (sum of exp(x - row_max)) of the tokens still in play
    limit = 0.0  # top-p: the mass above a kept token stays below this
    lo = tl.zeros([], tl.int64)  # search interval (lo, hi] of keys
    hi = tl.zeros([], tl.int64)
    mass_lo = 0.0  # the mass above lo
    count_lo = 0  # the tokens above lo
    count_hi = 0  # the tokens above hi, and their mass
    mass_hi = 0.0
    listed = 0  # 1: every token inside (lo, hi] is in its program's list, and search passes read the lists
    # This program's list: a column per lane of a search block, LIST_ROWS deep, so that a pass
    # appends without a scan across lanes (and in the same order every time).
    LIST_ROWS: tl.constexpr = LIST_CAP // SEARCH_BLOCK
    lane_len = tl.zeros([SEARCH_BLOCK], tl.int32)
    list_rows = 0  # the longest column
    num_kept = 0
    # Draw first, check after (module docstring): a sampled row without a top-k cut draws its
    # candidate in the stats pass, unless the launch counts kept tokens (which takes the threshold).
    drawing = ((temperature > 0.0) & (top_k >= vocab_size)).to(tl.int32)
    if MAX_DRAWS == 0:
        drawing = drawing * 0
    if WRITE_NUM_KEPT:
        drawing = drawing * 0
    checks = 0  # top-p checks of drawn candidates
    key_c = 0  # the candidate's key

    while kind != 4:  # _DONE
        # Thresholds of a search pass: even in value over the first VALUE_PASSES passes of a search
        # (logits are spread evenly in value, not in key: an interval that crosses zero, or spans
        # binades, holds most of its keys in values near zero that no token has), even in key
        # after, which bounds the passes (value steps may shrink a wide interval's keys slowly).
        step = ((hi - lo) * (thr_ids + 1).to(tl.int64)) // (NT + 1)
        by_key = (lo + step).to(tl.int32)
        lo_bits = (lo + 1).to(tl.int32)
        hi_bits = hi.to(tl.int32)
        v_lo = tl.where(lo_bits >= 0, lo_bits, lo_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        v_hi = tl.where(hi_bits >= 0, hi_bits, hi_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        v = v_lo + (v_hi - v_lo) * ((thr_ids + 1).to(tl.float32) / (NT + 1))
        v_key = v.to(tl.int32, bitcast=True)
        v_key = tl.where(v_key >= 0, v_key, v_key ^ 0x7FFFFFFF)
        v_key = tl.minimum(tl.maximum(v_key, (lo + 1).to(tl.int32)), hi.to(tl.int32))
        thresholds = tl.where((passes < VALUE_PASSES) & (hi - lo > NT + 1), v_key, by_key)
        # A full search pass lists the tokens inside (lo, hi] once they fit the lists: the row's
        # later passes read its candidates only (top-p at batch 512 reads ~5k of 128k).
        # Half the capacity: a column overflows only if its lanes draw twice their share of candidates.
        compact = ((LIST_ROWS > 0) & ((kind == 1) | (kind == 2)) & (listed == 0)
                   & (count_lo - count_hi <= LIST_CAP // 2))

        # This program's pass over its part of the row.
        f0 = float("-inf")
        f1 = 0.0
        f2 = float("-inf")
        i0 = 0
        i1 = 0
        i2 = 0
        i3 = 0
        i4 = 0
        counts = tl.zeros([NT], tl.int32)
        masses = tl.zeros([NT], tl.float32)
        if (kind == 0) | (kind == 3) | (kind == 5):  # _STATS, _DRAW, _CHECK: over the row, BLOCK a step
            # _STATS: max (first index), sum of exp(x - max), smallest finite key, finite count;
            # _CHECK: the mass and count of the tokens above the candidate;
            # _DRAW, and _STATS of a row that draws first: the best Gumbel score among the tokens
            # kept so far (key >= tau and min-p; in _STATS row_max is still -inf, so min-p keeps
            # every token), its first index, and (_DRAW) how many were kept.
            # Lanes serve several of these (registers decide how many programs an SM holds): the
            # argmax is a greedy row's, which never draws; the count is of finite, above or kept tokens.
            noisy = (kind == 3) | ((kind == 0) & (drawing == 1))
            lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_sum = tl.zeros([BLOCK], tl.float32)
            lane_best = tl.full([BLOCK], float("-inf"), tl.float32)
            lane_arg = tl.zeros([BLOCK], tl.int32) + begin  # of lane_max or of lane_best
            lane_lowest_key = tl.full([BLOCK], INT_MAX, tl.int32)
            lane_count = tl.zeros([BLOCK], tl.int32)
            seed = tl.load(seed_ptr + row)
            seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
            seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
            pre1, pre2, pre3 = prefetch.first_blocks(row_ptr, begin, end, BLOCK, PREFETCH)
            for start in range(begin, end, BLOCK):
                idx = start + cols
                raw, pre1, pre2, pre3 = prefetch.next_block(row_ptr, idx, end, pre1, pre2, pre3, BLOCK, PREFETCH)
                x = tl.math.div_rn(raw, divisor) + 0.0  # + 0.0: -0.0 becomes 0.0, one key per value
                finite = x > float("-inf")
                bits = x.to(tl.int32, bitcast=True)
                key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
                if kind == 0:
                    bigger = x > lane_max
                    new_max = tl.where(bigger, x, lane_max)
                    lane_sum = (tl.where(bigger, lane_sum * tl.exp(lane_max - new_max), lane_sum)
                                + tl.where(finite, tl.exp(x - new_max), 0.0))
                    lane_arg = tl.where(bigger & (drawing == 0), idx, lane_arg)
                    lane_max = new_max
                    lane_lowest_key = tl.minimum(lane_lowest_key, tl.where(finite, key, INT_MAX))
                    lane_count += finite.to(tl.int32)
                if kind == 5:
                    above = finite & (key > key_c)
                    lane_sum += tl.where(above, tl.exp(x - row_max), 0.0)
                    lane_count += above.to(tl.int32)
                if noisy:
                    kept = finite & (key >= tau)
                    if HAS_MIN_P:
                        kept = kept & (tl.exp(x - row_max) >= min_p)
                    # Noise only for blocks with a kept token (top-k keeps a few hundred of 128k).
                    if tl.max(kept.to(tl.int32), 0) > 0:
                        c0 = idx.to(tl.uint32)
                        c1 = c0 * 0
                        c2 = c1
                        c3 = c1
                        k0 = seed_lo
                        k1 = seed_hi
                        for _ in tl.static_range(10):
                            prev0 = c0
                            prev2 = c2
                            c0 = tl.umulhi(prev2, 0xCD9E8D57) ^ c1 ^ k0
                            c2 = tl.umulhi(prev0, 0xD2511F53) ^ c3 ^ k1
                            c1 = prev2 * 0xCD9E8D57
                            c3 = prev0 * 0xD2511F53
                            k0 = k0 + 0x9E3779B9
                            k1 = k1 + 0xBB67AE85
                        # U in (0, 1), exactly representable: odd multiples of 2**-24.
                        u = ((c0 >> 9).to(tl.int32) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
                        score = tl.where(kept, x - tl.log(-tl.log(u)), float("-inf"))
                        better = score > lane_best
                        lane_best = tl.where(better, score, lane_best)
                        lane_arg = tl.where(better, idx, lane_arg)
                    if kind == 3:
                        lane_count += kept.to(tl.int32)
            f0 = tl.max(lane_max, 0)
            if kind == 0:
                f1 = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - f0), 0.0), 0)
            else:
                f1 = tl.sum(lane_sum, 0)
            i0 = tl.min(tl.where(lane_max == f0, lane_arg, INT_MAX), 0)
            i1 = tl.min(lane_lowest_key, 0)
            i2 = tl.sum(lane_count, 0)
            f2 = tl.max(lane_best, 0)
            i4 = tl.min(tl.where(lane_best == f2, lane_arg, INT_MAX), 0)
        else:  # a search pass: count and mass above each threshold; count, min and max key inside (lo, hi]
            search_cols = tl.arange(0, SEARCH_BLOCK)
            tile_counts = tl.zeros([SEARCH_BLOCK, NT], tl.int32)
            tile_masses = tl.zeros([SEARCH_BLOCK, NT], tl.float32)
            lane_in = tl.zeros([SEARCH_BLOCK], tl.int32)
            lane_min_key = tl.full([SEARCH_BLOCK], INT_MAX, tl.int32)
            lane_max_key = tl.full([SEARCH_BLOCK], INT_MIN, tl.int32)
            # (lo, hi] in int32: lo >= the smallest finite key - 1 and hi <= the largest key, both in range.
            lo32 = lo.to(tl.int32)
            hi32 = hi.to(tl.int32)
            # A listed search reads this program's list (keys above hi there are stale: count_hi and
            # mass_hi hold them); otherwise the row, listing the tokens inside when compact.
            ceiling = tl.where(listed == 1, hi32, INT_MAX)
            num_steps = tl.where(listed == 1, list_rows, tl.cdiv(end - begin, SEARCH_BLOCK))
            if compact:
                lane_len = tl.zeros([SEARCH_BLOCK], tl.int32)
            pre_s1, pre_s2, pre_s3 = prefetch.first_blocks(row_ptr, begin, end, SEARCH_BLOCK, PREFETCH)
            for block_index in range(0, num_steps):
                if listed == 1:
                    key = tl.load(list_base + block_index * SEARCH_BLOCK + search_cols, mask=block_index < lane_len,
                                  other=INT_MIN)
                    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
                    x = bits.to(tl.float32, bitcast=True)
                else:
                    idx = begin + block_index * SEARCH_BLOCK + search_cols
                    raw, pre_s1, pre_s2, pre_s3 = prefetch.next_block(row_ptr, idx, end, pre_s1, pre_s2, pre_s3,
                                                                      SEARCH_BLOCK, PREFETCH)
                    x = tl.math.div_rn(raw, divisor) + 0.0
                    bits = x.to(tl.int32, bitcast=True)
                    key = tl.where(x > float("-inf"), tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF), INT_MIN)
                key = tl.where(key <= ceiling, key, INT_MIN)
                mass = tl.where(key > INT_MIN, tl.exp(x - row_max), 0.0)
                above = key[:, None] > thresholds[None, :]
                tile_counts += above.to(tl.int32)
                tile_masses += tl.where(above, mass[:, None], 0.0)
                inside = (key > lo32) & (key <= hi32)
                lane_in += inside.to(tl.int32)
                lane_min_key = tl.minimum(lane_min_key, tl.where(inside, key, INT_MAX))
                lane_max_key = tl.maximum(lane_max_key, tl.where(inside, key, INT_MIN))
                if compact:  # append the candidates to their lanes' columns (counting past a full one)
                    tl.store(list_base + lane_len * SEARCH_BLOCK + search_cols, key,
                             mask=inside & (lane_len < LIST_ROWS))
                    lane_len += inside.to(tl.int32)
            if compact:
                list_rows = tl.max(lane_len, 0)
                i3 = (list_rows > LIST_ROWS).to(tl.int32)  # overflowed: the row keeps reading itself
            counts = tl.sum(tile_counts, 0)
            masses = tl.sum(tile_masses, 0)
            i0 = tl.sum(lane_in, 0)
            i1 = tl.min(lane_min_key, 0)
            i2 = tl.max(lane_max_key, 0)

        # Publish this program's partials, wait for the row's other programs, read them all.
        record = ((row * 2 + rounds % 2) * splits + split) * WIDTH
        tl.store(part_f_ptr + record + thr_ids, masses)
        tl.store(part_i_ptr + record + thr_ids, counts)
        tl.store(part_f_ptr + record + NT, f0)
        tl.store(part_f_ptr + record + NT + 1, f1)
        tl.store(part_f_ptr + record + NT + 2, f2)
        tl.store(part_i_ptr + record + NT, i0)
        tl.store(part_i_ptr + record + NT + 1, i1)
        tl.store(part_i_ptr + record + NT + 2, i2)
        tl.store(part_i_ptr + record + NT + 3, i3)
        tl.store(part_i_ptr + record + NT + 4, i4)
        # The barrier orders every thread's stores before the (one-thread, acq_rel, gpu-scope) ticket.
        tl.debug_barrier()
        tl.atomic_add(counter_ptr + row, 1)
        rounds += 1
        arrived = tl.atomic_add(counter_ptr + row, 0)
        while arrived < rounds * splits:
            arrived = tl.atomic_add(counter_ptr + row, 0)
        records = ((row * 2 + (rounds - 1) % 2) * splits + split_ids) * WIDTH
        # .cg: from L2, never a line this SM cached before the other programs wrote it.
        all_f0 = tl.load(part_f_ptr + records + NT, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
        all_f1 = tl.load(part_f_ptr + records + NT + 1, mask=split_mask, other=0.0, cache_modifier=".cg")
        all_i0 = tl.load(part_i_ptr + records + NT, mask=split_mask, other=0, cache_modifier=".cg")
        all_i1 = tl.load(part_i_ptr + records + NT + 1, mask=split_mask, other=INT_MAX, cache_modifier=".cg")
        all_i2 = tl.load(part_i_ptr + records + NT + 2, mask=split_mask, other=0, cache_modifier=".cg")
        drew = (kind == 3) | ((kind == 0) & (drawing == 1))

        if kind == 0:
            row_max = tl.max(all_f0, 0)
            token = tl.min(tl.where(all_f0 == row_max, all_i0, INT_MAX), 0)
            z_dom = tl.sum(tl.where(all_f0 > float("-inf"), all_f1 * tl.exp(all_f0 - row_max), 0.0), 0)
            min_key = tl.min(all_i1, 0)
            num_finite = tl.sum(all_i2, 0)
            tau = min_key
            max_bits = row_max.to(tl.int32, bitcast=True)
            hi = tl.where(max_bits >= 0, max_bits, max_bits ^ 0x7FFFFFFF).to(tl.int64)
            lo = min_key.to(tl.int64) - 1
            mass_lo = z_dom
            count_lo = num_finite
            count_hi = 0
            mass_hi = 0.0
            listed = 0
            passes = 0
            limit = top_p * z_dom
            if greedy:
                kind = 4
            elif drawing == 1:
                kind = 3  # its first candidate came with the stats: checked below
            elif top_k < num_finite:
                kind = 1
            elif top_p < 1.0:
                kind = 2
            else:
                kind = 3
        elif kind == 5:  # _CHECK: top-p keeps the candidate if the mass strictly above it is below the limit
            mass_above = tl.sum(all_f1, 0)
            count_above = tl.sum(all_i2, 0)
            checks += 1
            if mass_above < limit:
                kind = 4
            else:
                # Every token at or below the candidate fails top-p too: draw again among those
                # above it, or after MAX_DRAWS checks search top-p's threshold above it.
                tau = key_c + 1
                lo = key_c.to(tl.int64)
                mass_lo = mass_above
                count_lo = count_above
                if checks < MAX_DRAWS:
                    kind = 3
                else:
                    drawing = 0
                    kind = 2
        elif kind != 3:
            thr_records = records[:, None] + thr_ids[None, :]
            thr_mask = split_mask[:, None]
            counts = tl.sum(tl.load(part_i_ptr + thr_records, mask=thr_mask, other=0, cache_modifier=".cg"), 0)
            masses = tl.sum(tl.load(part_f_ptr + thr_records, mask=thr_mask, other=0.0, cache_modifier=".cg"), 0)
            if listed == 1:
                counts += count_hi
                masses += mass_hi
            num_in = tl.sum(all_i0, 0)
            min_in = tl.min(all_i1, 0)
            max_in = tl.max(tl.where(split_mask, all_i2, INT_MIN), 0)
            if kind == 1:
                keep = counts < top_k
            else:
                keep = masses < limit
            # The test holds from the first kept threshold on (it is monotone in the threshold).
            first = tl.min(tl.where(keep, thr_ids, NT), 0)
            new_hi = tl.sum(tl.where(thr_ids == first, thresholds, 0), 0).to(tl.int64)
            new_lo = tl.sum(tl.where(thr_ids == first - 1, thresholds, 0), 0).to(tl.int64)
            new_mass_lo = tl.sum(tl.where(thr_ids == first - 1, masses, 0.0), 0)
            new_count_lo = tl.sum(tl.where(thr_ids == first - 1, counts, 0), 0)
            new_mass_hi = tl.sum(tl.where(thr_ids == first, masses, 0.0), 0)
            new_count_hi = tl.sum(tl.where(thr_ids == first, counts, 0), 0)
            if first < NT:
                hi_next = new_hi
                mass_hi = new_mass_hi
                count_hi = new_count_hi
            else:
                hi_next = hi
            if first > 0:
                lo_next = new_lo
                mass_lo = new_mass_lo
                count_lo = new_count_lo
            else:
                lo_next = lo
            if compact:
                all_i3 = tl.load(part_i_ptr + records + NT + 3, mask=split_mask, other=0, cache_modifier=".cg")
                if tl.max(all_i3, 0) == 0:
                    listed = 1
            # No token lies in (lo, min_in) or (max_in, hi]: tighten to the tokens' keys.
            lo_next = tl.maximum(lo_next, min_in.to(tl.int64) - 1)
            hi_next = tl.minimum(hi_next, max_in.to(tl.int64))
            passes += 1
            if num_in == 0 or min_in == max_in:
                # At most one distinct value in (lo, hi]: it has the tokens above hi above it, so it is kept.
                hi_next = lo + 1
                lo_next = lo
            lo = lo_next
            hi = hi_next
            if passes >= MAX_PASSES:
                hi = lo + 1

        # A search whose interval holds at most one key is over: keys above lo are kept.
        if kind == 1:
            if hi - lo <= 1:
                tau = (lo + 1).to(tl.int32)
                z_dom = mass_lo
                max_bits = row_max.to(tl.int32, bitcast=True)
                hi = tl.where(max_bits >= 0, max_bits, max_bits ^ 0x7FFFFFFF).to(tl.int64)
                count_hi = 0
                mass_hi = 0.0
                listed = 0
                passes = 0
                if top_p < 1.0:
                    kind = 2
                    limit = top_p * z_dom
                else:
                    kind = 3
        if kind == 2:
            if hi - lo <= 1:
                tau = (lo + 1).to(tl.int32)
                kind = 3

        # A draw pass (or a stats pass that drew): the best score, the first index on ties.
        if drew:
            all_f2 = tl.load(part_f_ptr + records + NT + 2, mask=split_mask, other=float("-inf"),
                             cache_modifier=".cg")
            all_i4 = tl.load(part_i_ptr + records + NT + 4, mask=split_mask, other=INT_MAX, cache_modifier=".cg")
            best = tl.max(all_f2, 0)
            token = tl.min(tl.where(all_f2 == best, all_i4, INT_MAX), 0)
            num_kept = tl.sum(all_i2, 0)
            kind = 4
            if drawing == 1:
                # The candidate maximises the score over every token still in play, a superset of
                # the kept ones: if the filters keep it, it is the draw.
                x_c = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), divisor) + 0.0
                bits_c = x_c.to(tl.int32, bitcast=True)
                key_c = tl.where(bits_c >= 0, bits_c, bits_c ^ 0x7FFFFFFF)
                if tl.exp(x_c - row_max) < min_p:
                    # Only a stats pass's candidate (drawn before row_max was known) can fail min-p,
                    # and with it every token at or below it: draw again above it, with min-p.
                    tau = key_c + 1
                    kind = 3
                elif top_p < 1.0:
                    kind = 5

    if split == 0:
        tl.store(token_ids_ptr + row, token.to(tl.int64))
        if WRITE_NUM_KEPT:
            tl.store(num_kept_ptr + row, num_kept)
        if WRITE_NUM_PASSES:
            tl.store(num_passes_ptr + row, rounds)
    # Leave the counter at zero for the next launch: the last program of the row resets it, once
    # every program is past its last wait.
    ticket = tl.atomic_add(counter_ptr + row, 1)
    if ticket == (rounds + 1) * splits - 1:
        tl.atomic_xchg(counter_ptr + row, 0)


# The parameter pointers are slices of one host->device copy whose offsets depend on the batch size:
# left specialised on alignment they would compile a variant per batch size modulo 4.
_sample = lazy_jit(_sample_kernel, do_not_specialize=("temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr",
                                                      "seed_ptr", "vocab_size", "chunk"))

# One int32 per row, per device: zero between launches (the kernel leaves them so); launches sharing
# them must be ordered, i.e. issued on one stream.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NUM_SMS: dict[torch.device, int] = {}
# Programs of one compiled variant that an SM holds at once, learnt from its first launch.
_RESIDENT_PER_SM: dict[tuple[torch.device, tuple], int] = {}


def sample(logits: torch.Tensor, temperature: torch.Tensor, *, seeds: torch.Tensor,
           top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
           min_p: torch.Tensor | None = None, num_kept: torch.Tensor | None = None,
           num_passes: torch.Tensor | None = None, config: SamplingConfig | None = None) -> torch.Tensor:
    """One token per row of `logits` [B, V] (float32, bfloat16 or float16): [B] int64.

    temperature [B] float32 (0: greedy); seeds [B] int64 (each row's Philox key, 0 <= seed < 2**63);
    top_k [B] int (rows without a filter hold V), top_p [B] float32 (1.0: off), min_p [B] float32
    (0.0: off); None turns a filter off for every row. num_kept: an optional [B] int32 output, how
    many tokens each sampled row kept, 0 on greedy rows (for tests and diagnostics; counting takes
    the threshold search, so no row draws first). num_passes: an optional [B] int32 output, the
    passes each row took (over the row or its list). config: launch parameters (default:
    pick_config's for the batch size)."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous in its last dimension, got strides {logits.stride()}")
    num_rows, vocab_size = logits.shape
    device = logits.device
    check_operand("temperature", temperature, (num_rows,), torch.float32, device)
    check_operand("seeds", seeds, (num_rows,), torch.int64, device)
    if top_k is not None:
        check_tensor("top_k", top_k, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
        if top_k.shape[0] != num_rows:
            raise ValueError(f"top_k must have shape ({num_rows},), got {tuple(top_k.shape)}")
    for name, values in (("top_p", top_p), ("min_p", min_p)):
        if values is not None:
            check_operand(name, values, (num_rows,), torch.float32, device)
    for name, output in (("num_kept", num_kept), ("num_passes", num_passes)):
        if output is not None:
            check_operand(name, output, (num_rows,), torch.int32, device)
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return token_ids
    config = config or pick_config(num_rows, device)
    variant = (config, top_k is not None, top_p is not None, min_p is not None, num_kept is not None,
               num_passes is not None)
    splits = _splits(device, num_rows, vocab_size, config, variant)
    chunk = -(-vocab_size // (splits * config.block)) * config.block
    splits = -(-vocab_size // chunk)
    part_f = torch.empty(num_rows * 2 * splits * RECORD_WIDTH, dtype=torch.float32, device=device)
    part_i = torch.empty(num_rows * 2 * splits * RECORD_WIDTH, dtype=torch.int32, device=device)
    candidates = torch.empty(max(1, num_rows * splits * config.list_capacity), dtype=torch.int32, device=device)
    kernel = _sample[(splits, num_rows)](
        logits, logits.stride(0), temperature,
        top_k if top_k is not None else seeds, top_p if top_p is not None else temperature,
        min_p if min_p is not None else temperature, seeds,
        token_ids, num_kept if num_kept is not None else part_i, num_passes if num_passes is not None else part_i,
        part_f, part_i, _counters(device, num_rows),
        candidates, vocab_size, chunk,
        BLOCK=config.block, SEARCH_BLOCK=config.search_block, NT=config.num_thresholds, WIDTH=RECORD_WIDTH,
        SPLITS_P2=MAX_SPLITS, VALUE_PASSES=config.value_passes, MAX_PASSES=config.max_passes,
        PREFETCH=config.prefetch, LIST_CAP=config.list_capacity, HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None, MAX_DRAWS=config.max_draws,
        WRITE_NUM_KEPT=num_kept is not None, WRITE_NUM_PASSES=num_passes is not None,
        # One num_warps per config: each value is a variant to compile (and warm up).
        num_warps=config.num_warps, maxnreg=config.max_registers,
    )
    if (device, variant) not in _RESIDENT_PER_SM and getattr(kernel, "n_regs", None) is not None:
        _RESIDENT_PER_SM[device, variant] = _resident_per_sm(device, kernel.n_regs, kernel.metadata.shared,
                                                             config.num_warps)
    return token_ids


def pick_config(num_rows: int, device: torch.device | None = None) -> SamplingConfig:
    """The config measured on `device` (None: the current one) for the smallest batch bucket holding
    num_rows (the largest bucket's beyond), DEFAULT_CONFIG without a table."""
    table = configs.table("sample", TABLE_KEY, device, SamplingConfig)
    buckets = [rows for (rows,) in table]
    bucket = configs.bucket(num_rows, buckets)
    if bucket is None:
        bucket = max(buckets, default=None)
    return DEFAULT_CONFIG if bucket is None else table[(bucket,)]


def tuned_configs(device: torch.device | None = None) -> list[SamplingConfig]:
    """Every config pick_config may return on `device`, once each, smallest bucket first."""
    table = configs.table("sample", TABLE_KEY, device, SamplingConfig)
    return list(dict.fromkeys(table[key] for key in sorted(table))) or [DEFAULT_CONFIG]


def _splits(device: torch.device, num_rows: int, vocab_size: int, config: SamplingConfig, variant: tuple) -> int:
    """Programs per row: enough to reach config.programs_per_sm programs per SM, few enough that
    every program of the launch is resident at once (they wait for each other). Until a variant has
    run once its occupancy is unknown, and the launch keeps to one program per SM, which always
    resides."""
    if device.type != "cuda" or interpreting():
        return 1
    num_sms = _NUM_SMS.get(device)
    if num_sms is None:
        num_sms = _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = min(config.programs_per_sm, _RESIDENT_PER_SM.get((device, variant), 1))
    return max(1, min(MAX_SPLITS, num_sms * per_sm // num_rows, -(-vocab_size // config.block)))


def _resident_per_sm(device: torch.device, regs_per_thread: int, shared_bytes: int, num_warps: int) -> int:
    """How many programs of a compiled kernel one SM holds at once, by registers (allocated per warp
    in units of 256), threads and shared memory (plus the 1 KiB the runtime reserves per block)."""
    props = torch.cuda.get_device_properties(device)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_per_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 << 10)
    regs_per_warp = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_threads = threads_per_sm // (32 * num_warps)
    by_shared = shared_per_sm // (shared_bytes + 1024)
    return max(1, min(by_regs, by_threads, by_shared, 32))


def _counters(device: torch.device, count: int) -> torch.Tensor:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        counters = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def warm_up(device: torch.device, vocab_size: int) -> None:
    """Compile the kernel's variants for the filter combinations requests commonly use (temperature
    alone, top-k, top-p, both) in every config pick_config may return, so that the first such
    request does not wait for the compiler."""
    logits = torch.zeros(1, vocab_size, device=device)
    ones = torch.ones(1, device=device)
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    top_k = torch.ones(1, dtype=torch.int64, device=device)
    for config in tuned_configs(device):
        for filters in ({}, {"top_k": top_k}, {"top_p": ones * 0.5}, {"top_k": top_k, "top_p": ones * 0.5}):
            sample(logits, ones, seeds=seeds, config=config, **filters)


# --- The pure-torch reference: the same draws, by a full sort --------------------------------------


def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, *, seeds: torch.Tensor,
                     top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                     min_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `sample` draws, computed with a full sort of each row: (token ids [B] int64, number of
    kept tokens [B] int32, 0 on greedy rows). The engine's sampler on the CPU."""
    greedy = temperature <= 0
    x = scaled_logits(logits, temperature)
    kept = kept_mask_reference(x, top_k, top_p, min_p)
    rows, cols = kept.nonzero(as_tuple=True)
    # Noise only where it can matter: a kept token's noise is a function of (seed, token id) alone.
    score = torch.full_like(x, float("-inf"))
    score[rows, cols] = x[rows, cols] + gumbel_noise(seeds[rows], cols)
    token_ids = torch.where(greedy, logits.float().argmax(dim=-1), score.argmax(dim=-1))
    num_kept = torch.where(greedy, 0, kept.sum(dim=-1, dtype=torch.int32))
    return token_ids, num_kept


def scaled_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """x = logits / temperature in float32 (greedy rows: the logits), -0.0 made 0.0."""
    divisor = torch.where(temperature <= 0, torch.ones_like(temperature), temperature)
    return logits.float() / divisor[:, None] + 0.0


def kept_mask_reference(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                        min_p: torch.Tensor | None) -> torch.Tensor:
    """[B, V] bool: the tokens that top-k, then top-p, then min-p keep (the module's semantics)."""
    num_rows, vocab_size = x.shape
    kept = x > float("-inf")
    sorted_x, order = x.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_x.gather(1, (top_k.long().clamp(1, vocab_size) - 1)[:, None])
        kept &= x >= kth
        sorted_x = torch.where(sorted_x >= kth, sorted_x, float("-inf"))
    if top_p is not None:
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Tied tokens share the mass strictly above their value: that of the first of them.
        group_start = torch.ones_like(kept)
        group_start[:, 1:] = sorted_x[:, 1:] != sorted_x[:, :-1]
        mass_above = torch.cummax(torch.where(group_start, mass_before, 0.0), dim=-1).values
        keep_sorted = (mass_above < top_p[:, None]) | (top_p[:, None] >= 1.0)
        kept &= torch.zeros_like(kept).scatter(1, order, keep_sorted)
    if min_p is not None:
        probs = torch.softmax(torch.where(kept, x, float("-inf")), dim=-1)
        kept &= probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return kept


_MASK32 = 0xFFFFFFFF


def philox_bits(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Philox-4x32-10's first output word for key `seeds` (int64) at counter (counters, 0, 0, 0), as
    int64 in [0, 2**32): what tl.randint(seed, counter) gives for int32 counters."""
    c0 = counters.long() & _MASK32
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = (seeds.long() & _MASK32).expand_as(c0)
    k1 = ((seeds.long() >> 32) & _MASK32).expand_as(c0)
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul_hi_lo(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    return c0


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of a * b (both < 2**32) without overflowing int64."""
    p_lo = b * (a & 0xFFFF)
    q = b * (a >> 16) + (p_lo >> 16)
    return q >> 16, ((q & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def gumbel_noise(seeds: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """-log(-log U) in float32, U in (0, 1) from Philox's bits as the kernel makes it."""
    bits = philox_bits(seeds, token_ids)
    u = ((bits >> 9) * 2 + 1).float() * 2.0**-24
    return -torch.log(-torch.log(u))
