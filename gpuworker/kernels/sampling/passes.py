"""The sampling kernel's device functions (sample.py holds the kernel and describes the algorithm): the
row's states, the passes a row's programs make over their parts of the row, and the steps that turn
a round's partials into the row's next state.

Every round each program of a row makes one pass (row_pass for STATS, DRAW and CHECK; search_pass
for TOP_K and TOP_P), publishes its partial record and waits for the others (publish), then each
reads them all (gather) and reduces them in the same order (reduce_stats, check_candidate,
narrow_search, end_search, take_draw), so that the row's programs agree on its next state.

Triton inlines these, so the kernel compiles to the PTX it had as one body, provided one rule holds:
a function takes the row state it may reassign (and returns it) in the order the kernel first defines
it (kind, rounds, search_passes, row_max, token, tau, num_finite, z_dom, limit, lo, hi, mass_lo,
count_lo, count_hi, mass_hi, listed, lane_len, list_rows, num_kept, drawing, checks, key_c). Triton
orders the results of an `if` by the order in which the function first binds their names, its
parameters first; another order renumbers the registers of the loop's state in the PTX (the same
instructions, another fingerprint in tests/kernels/ptx_inventory.py).

Kernels call these through the module, so the interpreter's launches can swap in interpretable twins
(launch.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gpuworker.kernels.device import prefetch

# Row states (the kernel's `kind`): what the row's next pass does.
STATS = tl.constexpr(0)  # max, sum of exp(x - max), smallest key, finite count (and a candidate's draw)
TOP_K = tl.constexpr(1)  # a search pass for top-k's threshold
TOP_P = tl.constexpr(2)  # a search pass for top-p's threshold
DRAW = tl.constexpr(3)  # a Gumbel draw among the kept tokens
DONE = tl.constexpr(4)  # the row has its token
CHECK = tl.constexpr(5)  # the mass above a drawn candidate, for top-p's test

INT_MAX = tl.constexpr(2147483647)
INT_MIN = tl.constexpr(-2147483648)


@triton.jit
def key_of(x):
    """float32 values as int32 keys in value order (-0.0 just below 0.0: the kernel adds 0.0 first)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def value_of(key):
    """The float32 values of keys (key_of's inverse)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def load_filters(
    row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    """The row's (temperature, greedy, divisor of the logits, top_k, top_p, min_p); a filter the launch
    has not got is off."""
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
    return temperature, greedy, divisor, top_k, top_p, min_p


@triton.jit
def draws_first(temperature, top_k, vocab_size, MAX_DRAWS: tl.constexpr, WRITE_NUM_KEPT: tl.constexpr):
    """1 where the row draws its candidate in the stats pass and checks it after (sample.py's docstring):
    a sampled row without a top-k cut, unless the launch counts kept tokens (which takes the
    threshold) or never draws first (MAX_DRAWS 0); else 0."""
    drawing = ((temperature > 0.0) & (top_k >= vocab_size)).to(tl.int32)
    if MAX_DRAWS == 0:
        drawing = drawing * 0
    if WRITE_NUM_KEPT:
        drawing = drawing * 0
    return drawing


@triton.jit
def empty_record(NT: tl.constexpr):
    """A program's partial record as neither pass fills it: (f0, f1, f2, i0, i1, i2, i3, i4, counts,
    masses); row_pass fills the scalars but i3, search_pass all but f0, f1, f2 and i4."""
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
    return f0, f1, f2, i0, i1, i2, i3, i4, counts, masses


@triton.jit
def search_thresholds(lo, hi, search_passes, thr_ids, NT: tl.constexpr, VALUE_PASSES: tl.constexpr):
    """The NT keys inside the search interval (lo, hi] that a search pass counts the tokens above.

    Even in value over the first VALUE_PASSES passes of a search (logits are spread evenly in value,
    not in key: an interval that crosses zero, or spans binades, holds most of its keys in values
    near zero that no token has), even in key after, which bounds the passes (value steps may shrink
    a wide interval's keys slowly)."""
    step = ((hi - lo) * (thr_ids + 1).to(tl.int64)) // (NT + 1)
    by_key = (lo + step).to(tl.int32)
    lo_bits = (lo + 1).to(tl.int32)
    hi_bits = hi.to(tl.int32)
    v_lo = value_of(lo_bits)
    v_hi = value_of(hi_bits)
    v = v_lo + (v_hi - v_lo) * ((thr_ids + 1).to(tl.float32) / (NT + 1))
    v_key = tl.minimum(tl.maximum(key_of(v), (lo + 1).to(tl.int32)), hi.to(tl.int32))
    return tl.where((search_passes < VALUE_PASSES) & (hi - lo > NT + 1), v_key, by_key)


@triton.jit
def philox_uniform(idx, seed_lo, seed_hi):
    """U in (0, 1) per token id: Philox-4x32-10 keyed by the seed at counter (idx, 0, 0, 0), its first
    word's top 23 bits as an odd multiple of 2**-24 (exactly representable, never 0 or 1)."""
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
    return ((c0 >> 9).to(tl.int32) * 2 + 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _stats_block(x, finite, key, idx, drawing, lane_max, lane_sum, lane_arg, lane_lowest_key, lane_count):
    """A block's share of the stats: per lane the running max (its first index, unless the row draws
    first: then lane_arg is the draw's), the sum of exp(x - max), the smallest finite key and the
    finite count."""
    bigger = x > lane_max
    new_max = tl.where(bigger, x, lane_max)
    lane_sum = tl.where(bigger, lane_sum * tl.exp(lane_max - new_max), lane_sum) + tl.where(
        finite, tl.exp(x - new_max), 0.0
    )
    lane_arg = tl.where(bigger & (drawing == 0), idx, lane_arg)
    lane_max = new_max
    lane_lowest_key = tl.minimum(lane_lowest_key, tl.where(finite, key, INT_MAX))
    lane_count += finite.to(tl.int32)
    return lane_max, lane_sum, lane_arg, lane_lowest_key, lane_count


@triton.jit
def _draw_block(x, kept, idx, seed_lo, seed_hi, lane_best, lane_arg):
    """A block's share of the Gumbel draw: per lane the best x - log(-log U) among the kept tokens
    and its first index."""
    u = philox_uniform(idx, seed_lo, seed_hi)
    score = tl.where(kept, x - tl.log(-tl.log(u)), float("-inf"))
    better = score > lane_best
    lane_best = tl.where(better, score, lane_best)
    lane_arg = tl.where(better, idx, lane_arg)
    return lane_best, lane_arg


@triton.jit
def row_pass(
    kind,
    drawing,
    row_ptr,
    seed_ptr,
    row,
    begin,
    end,
    cols,
    divisor,
    tau,
    row_max,
    min_p,
    key_c,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    """A STATS, DRAW or CHECK pass over this program's part of the row, BLOCK logits a step: its
    partials (f0, f1, f2, i0, i1, i2, i4).

    STATS: max (f0, first index i0), sum of exp(x - max) (f1), smallest finite key (i1), finite count
    (i2). CHECK: the mass (f1) and count (i2) of the tokens above the candidate. DRAW, and STATS of a
    row that draws first: the best Gumbel score among the tokens kept so far (f2; key >= tau and
    min-p; in STATS row_max is still -inf, so min-p keeps every token), its first index (i4), and
    (DRAW) how many were kept (i2). Lanes serve several of these (registers decide how many programs
    an SM holds): the argmax is a greedy row's, which never draws; the count is of finite, above or
    kept tokens."""
    noisy = (kind == DRAW) | ((kind == STATS) & (drawing == 1))
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
        key = key_of(x)
        if kind == STATS:
            lane_max, lane_sum, lane_arg, lane_lowest_key, lane_count = _stats_block(
                x, finite, key, idx, drawing, lane_max, lane_sum, lane_arg, lane_lowest_key, lane_count
            )
        if kind == CHECK:
            above = finite & (key > key_c)
            lane_sum += tl.where(above, tl.exp(x - row_max), 0.0)
            lane_count += above.to(tl.int32)
        if noisy:
            kept = finite & (key >= tau)
            if HAS_MIN_P:
                kept = kept & (tl.exp(x - row_max) >= min_p)
            # Noise only for blocks with a kept token (top-k keeps a few hundred of 128k).
            if tl.max(kept.to(tl.int32), 0) > 0:
                lane_best, lane_arg = _draw_block(x, kept, idx, seed_lo, seed_hi, lane_best, lane_arg)
            if kind == DRAW:
                lane_count += kept.to(tl.int32)
    f0 = tl.max(lane_max, 0)
    if kind == STATS:
        f1 = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - f0), 0.0), 0)
    else:
        f1 = tl.sum(lane_sum, 0)
    i0 = tl.min(tl.where(lane_max == f0, lane_arg, INT_MAX), 0)
    i1 = tl.min(lane_lowest_key, 0)
    i2 = tl.sum(lane_count, 0)
    f2 = tl.max(lane_best, 0)
    i4 = tl.min(tl.where(lane_best == f2, lane_arg, INT_MAX), 0)
    return f0, f1, f2, i0, i1, i2, i4


@triton.jit
def search_pass(
    row_ptr,
    list_base,
    begin,
    end,
    divisor,
    row_max,
    lo,
    hi,
    listed,
    lane_len,
    list_rows,
    thresholds,
    compact,
    SEARCH_BLOCK: tl.constexpr,
    NT: tl.constexpr,
    PREFETCH: tl.constexpr,
    LIST_ROWS: tl.constexpr,
):
    """A TOP_K or TOP_P search pass over this program's part of the row, or its list once `listed`:
    the count and mass above each threshold (counts, masses), and the count, smallest and largest key
    inside (lo, hi] (i0, i1, i2); when `compact`, the tokens inside are also appended to the list
    (i3: it overflowed, and the row keeps reading itself). Returns (counts, masses, i0, i1, i2, i3,
    lane_len, list_rows)."""
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
            key = tl.load(
                list_base + block_index * SEARCH_BLOCK + search_cols, mask=block_index < lane_len, other=INT_MIN
            )
            x = value_of(key)
        else:
            idx = begin + block_index * SEARCH_BLOCK + search_cols
            raw, pre_s1, pre_s2, pre_s3 = prefetch.next_block(
                row_ptr, idx, end, pre_s1, pre_s2, pre_s3, SEARCH_BLOCK, PREFETCH
            )
            x = tl.math.div_rn(raw, divisor) + 0.0
            key = tl.where(x > float("-inf"), key_of(x), INT_MIN)
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
            tl.store(list_base + lane_len * SEARCH_BLOCK + search_cols, key, mask=inside & (lane_len < LIST_ROWS))
            lane_len += inside.to(tl.int32)
    i3 = 0
    if compact:
        list_rows = tl.max(lane_len, 0)
        i3 = (list_rows > LIST_ROWS).to(tl.int32)  # overflowed: the row keeps reading itself
    counts = tl.sum(tile_counts, 0)
    masses = tl.sum(tile_masses, 0)
    i0 = tl.sum(lane_in, 0)
    i1 = tl.min(lane_min_key, 0)
    i2 = tl.max(lane_max_key, 0)
    return counts, masses, i0, i1, i2, i3, lane_len, list_rows


@triton.jit
def publish(
    part_f_ptr,
    part_i_ptr,
    counter_ptr,
    row,
    split,
    splits,
    rounds,
    thr_ids,
    masses,
    counts,
    f0,
    f1,
    f2,
    i0,
    i1,
    i2,
    i3,
    i4,
    NT: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Store this program's partials of the round, then wait until every program of the row has
    stored its own: the number of rounds done."""
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
    return rounds


@triton.jit
def gather(part_f_ptr, part_i_ptr, row, splits, split_ids, split_mask, rounds, NT: tl.constexpr, WIDTH: tl.constexpr):
    """The row's records of the last round, and its programs' f0, f1, i0, i1, i2 (every state reads some)."""
    records = ((row * 2 + (rounds - 1) % 2) * splits + split_ids) * WIDTH
    # .cg: from L2, never a line this SM cached before the other programs wrote it.
    all_f0 = tl.load(part_f_ptr + records + NT, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
    all_f1 = tl.load(part_f_ptr + records + NT + 1, mask=split_mask, other=0.0, cache_modifier=".cg")
    all_i0 = tl.load(part_i_ptr + records + NT, mask=split_mask, other=0, cache_modifier=".cg")
    all_i1 = tl.load(part_i_ptr + records + NT + 1, mask=split_mask, other=INT_MAX, cache_modifier=".cg")
    all_i2 = tl.load(part_i_ptr + records + NT + 2, mask=split_mask, other=0, cache_modifier=".cg")
    return records, all_f0, all_f1, all_i0, all_i1, all_i2


@triton.jit
def reduce_stats(all_f0, all_f1, all_i0, all_i1, all_i2):
    """The row's (max, its first index, sum of exp(x - max), smallest finite key, finite count)."""
    row_max = tl.max(all_f0, 0)
    token = tl.min(tl.where(all_f0 == row_max, all_i0, INT_MAX), 0)
    z_dom = tl.sum(tl.where(all_f0 > float("-inf"), all_f1 * tl.exp(all_f0 - row_max), 0.0), 0)
    min_key = tl.min(all_i1, 0)
    num_finite = tl.sum(all_i2, 0)
    return row_max, token, z_dom, min_key, num_finite


@triton.jit
def state_after_stats(greedy, drawing, top_k, num_finite, top_p):
    """Where a row goes from its stats: a greedy row has its token (the argmax); a row that drew
    first checks its candidate (take_draw); the others search top-k's threshold, or top-p's, or draw."""
    if greedy:
        kind = DONE
    elif drawing == 1:
        kind = DRAW  # its first candidate came with the stats: checked in take_draw
    elif top_k < num_finite:
        kind = TOP_K
    elif top_p < 1.0:
        kind = TOP_P
    else:
        kind = DRAW
    return kind


@triton.jit
def check_candidate(
    kind, tau, limit, lo, mass_lo, count_lo, drawing, checks, key_c, all_f1, all_i2, MAX_DRAWS: tl.constexpr
):
    """After a CHECK pass: top-p keeps the candidate if the mass strictly above it is below the limit.
    Returns (kind, tau, lo, mass_lo, count_lo, drawing, checks)."""
    mass_above = tl.sum(all_f1, 0)
    count_above = tl.sum(all_i2, 0)
    checks += 1
    if mass_above < limit:
        kind = DONE
    else:
        # Every token at or below the candidate fails top-p too: draw again among those
        # above it, or after MAX_DRAWS checks search top-p's threshold above it.
        tau = key_c + 1
        lo = key_c.to(tl.int64)
        mass_lo = mass_above
        count_lo = count_above
        if checks < MAX_DRAWS:
            kind = DRAW
        else:
            drawing = 0
            kind = TOP_P
    return kind, tau, lo, mass_lo, count_lo, drawing, checks


@triton.jit
def narrow_search(
    top_k,
    kind,
    search_passes,
    limit,
    lo,
    hi,
    mass_lo,
    count_lo,
    count_hi,
    mass_hi,
    listed,
    thresholds,
    compact,
    part_f_ptr,
    part_i_ptr,
    records,
    thr_ids,
    split_mask,
    all_i0,
    all_i1,
    all_i2,
    NT: tl.constexpr,
    MAX_PASSES: tl.constexpr,
):
    """After a search pass: the sub-interval of (lo, hi] where the filter's test flips, tightened to
    the keys the tokens inside have, with the count and mass above its ends; a search that has run
    MAX_PASSES passes, or whose interval holds at most one distinct value, ends (hi = lo + 1). Once
    a compacting pass has listed every token inside in its program's list, the search reads the lists
    (listed). Returns (search_passes, lo, hi, mass_lo, count_lo, count_hi, mass_hi, listed)."""
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
    if kind == TOP_K:
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
    search_passes += 1
    if num_in == 0 or min_in == max_in:
        # At most one distinct value in (lo, hi]: it has the tokens above hi above it, so it is kept.
        hi_next = lo + 1
        lo_next = lo
    lo = lo_next
    hi = hi_next
    if search_passes >= MAX_PASSES:
        hi = lo + 1
    return search_passes, lo, hi, mass_lo, count_lo, count_hi, mass_hi, listed


@triton.jit
def end_search(top_p, kind, search_passes, row_max, tau, z_dom, limit, lo, hi, mass_lo, count_hi, mass_hi, listed):
    """A search whose interval holds at most one key is over: keys above lo are kept (tau). Top-k's
    starts top-p's over its kept tokens, or the draw; top-p's the draw. Returns (kind, search_passes,
    tau, z_dom, limit, hi, count_hi, mass_hi, listed)."""
    if kind == TOP_K:
        if hi - lo <= 1:
            tau = (lo + 1).to(tl.int32)
            z_dom = mass_lo
            hi = key_of(row_max).to(tl.int64)
            count_hi = 0
            mass_hi = 0.0
            listed = 0
            search_passes = 0
            if top_p < 1.0:
                kind = TOP_P
                limit = top_p * z_dom
            else:
                kind = DRAW
    if kind == TOP_P:
        if hi - lo <= 1:
            tau = (lo + 1).to(tl.int32)
            kind = DRAW
    return kind, search_passes, tau, z_dom, limit, hi, count_hi, mass_hi, listed


@triton.jit
def take_draw(
    row_ptr,
    divisor,
    min_p,
    top_p,
    kind,
    row_max,
    tau,
    drawing,
    key_c,
    part_f_ptr,
    part_i_ptr,
    records,
    split_mask,
    all_i2,
    NT: tl.constexpr,
):
    """After a DRAW pass, or a STATS pass that drew: the best score's token (the first index on ties)
    and the kept count. A candidate drawn first is checked: it fails min-p (draw again above it,
    DRAW), or top-p checks it (CHECK), else it is the row's token (DONE). Returns (kind, token, tau,
    num_kept, key_c)."""
    all_f2 = tl.load(part_f_ptr + records + NT + 2, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
    all_i4 = tl.load(part_i_ptr + records + NT + 4, mask=split_mask, other=INT_MAX, cache_modifier=".cg")
    best = tl.max(all_f2, 0)
    token = tl.min(tl.where(all_f2 == best, all_i4, INT_MAX), 0)
    num_kept = tl.sum(all_i2, 0)
    kind = DONE
    if drawing == 1:
        # The candidate maximises the score over every token still in play, a superset of
        # the kept ones: if the filters keep it, it is the draw.
        x_c = tl.math.div_rn(tl.load(row_ptr + token).to(tl.float32), divisor) + 0.0
        key_c = key_of(x_c)
        if tl.exp(x_c - row_max) < min_p:
            # Only a stats pass's candidate (drawn before row_max was known) can fail min-p,
            # and with it every token at or below it: draw again above it, with min-p.
            tau = key_c + 1
            kind = DRAW
        elif top_p < 1.0:
            kind = CHECK
    return kind, token, tau, num_kept, key_c


@triton.jit
def finish(
    token_ids_ptr,
    num_kept_ptr,
    num_passes_ptr,
    counter_ptr,
    row,
    split,
    splits,
    token,
    num_kept,
    rounds,
    WRITE_NUM_KEPT: tl.constexpr,
    WRITE_NUM_PASSES: tl.constexpr,
):
    """Write the row's token (and kept count, passes) from its first program, and leave the row's
    counter at zero for the next launch: the last program of the row resets it, once every program
    is past its last wait."""
    if split == 0:
        tl.store(token_ids_ptr + row, token.to(tl.int64))
        if WRITE_NUM_KEPT:
            tl.store(num_kept_ptr + row, num_kept)
        if WRITE_NUM_PASSES:
            tl.store(num_passes_ptr + row, rounds)
    ticket = tl.atomic_add(counter_ptr + row, 1)
    if ticket == (rounds + 1) * splits - 1:
        tl.atomic_xchg(counter_ptr + row, 0)
