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

The kernel below is the row's state machine, a loop of rounds until the row is DONE; its passes, the
steps from one state to the next and the states themselves live in passes.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.launch import check_operand, check_tensor, interpreting, lazy_jit
from gpuworker.kernels.sampling import passes
from gpuworker.kernels.sampling.passes import CHECK, DONE, DRAW, INT_MIN, STATS, TOP_K, TOP_P

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
        for field, value, low, high in (
            ("block", self.block, 16, 1 << 16),
            ("search_block", self.search_block, 16, 1 << 16),
            ("num_thresholds", self.num_thresholds, 2, MAX_THRESHOLDS),
            ("num_warps", self.num_warps, 1, 32),
        ):
            if not low <= value <= high or value & (value - 1):
                raise ValueError(f"SamplingConfig.{field} must be a power of two in [{low}, {high}], got {value}")
        if not 0 <= self.prefetch <= 3:
            raise ValueError(f"SamplingConfig.prefetch must be in [0, 3], got {self.prefetch}")
        if not 0 <= self.value_passes <= 8:
            raise ValueError(f"SamplingConfig.value_passes must be in [0, 8], got {self.value_passes}")
        if not 0 <= self.list_capacity <= 1 << 20 or self.list_capacity % self.search_block:
            raise ValueError(
                f"SamplingConfig.list_capacity must be a multiple of search_block "
                f"({self.search_block}) in [0, {1 << 20}], got {self.list_capacity}"
            )
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
        return (
            f"b{self.block}-s{self.search_block}-t{self.num_thresholds}-v{self.value_passes}-w{self.num_warps}"
            f"-f{self.prefetch}-p{self.programs_per_sm}-l{self.list_capacity}"
            f"{'' if self.max_registers is None else f'-r{self.max_registers}'}-d{self.max_draws}"
        )


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


def _sample_kernel(
    logits_ptr,
    stride_logits,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    token_ids_ptr,
    num_kept_ptr,
    num_passes_ptr,
    part_f_ptr,
    part_i_ptr,
    counter_ptr,
    list_ptr,
    vocab_size,
    chunk,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    NT: tl.constexpr,
    WIDTH: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    VALUE_PASSES: tl.constexpr,
    MAX_PASSES: tl.constexpr,
    PREFETCH: tl.constexpr,
    LIST_CAP: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    MAX_DRAWS: tl.constexpr,
    WRITE_NUM_KEPT: tl.constexpr,
    WRITE_NUM_PASSES: tl.constexpr,
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
    temperature, greedy, divisor, top_k, top_p, min_p = passes.load_filters(
        row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, HAS_TOP_K, HAS_TOP_P, HAS_MIN_P
    )

    # Row state, the same in every program of the row (each reduces the same partials in one order).
    kind = STATS
    rounds = 0  # passes done so far (and barriers passed)
    search_passes = 0  # passes of the current search
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
    drawing = passes.draws_first(temperature, top_k, vocab_size, MAX_DRAWS, WRITE_NUM_KEPT)
    checks = 0  # top-p checks of drawn candidates
    key_c = 0  # the candidate's key

    while kind != DONE:
        thresholds = passes.search_thresholds(lo, hi, search_passes, thr_ids, NT, VALUE_PASSES)
        # A full search pass lists the tokens inside (lo, hi] once they fit the lists: the row's
        # later passes read its candidates only (top-p at batch 512 reads ~5k of 128k).
        # Half the capacity: a column overflows only if its lanes draw twice their share of candidates.
        compact = (
            (LIST_ROWS > 0)
            & ((kind == TOP_K) | (kind == TOP_P))
            & (listed == 0)
            & (count_lo - count_hi <= LIST_CAP // 2)
        )

        # This program's pass over its part of the row: its partial record (what a pass does not
        # compute stays empty).
        f0, f1, f2, i0, i1, i2, i3, i4, counts, masses = passes.empty_record(NT)
        if (kind == STATS) | (kind == DRAW) | (kind == CHECK):
            f0, f1, f2, i0, i1, i2, i4 = passes.row_pass(
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
                BLOCK,
                PREFETCH,
                HAS_MIN_P,
            )
        else:
            counts, masses, i0, i1, i2, i3, lane_len, list_rows = passes.search_pass(
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
                SEARCH_BLOCK,
                NT,
                PREFETCH,
                LIST_ROWS,
            )

        # Publish this program's partials, wait for the row's other programs, read them all.
        rounds = passes.publish(
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
            NT,
            WIDTH,
        )
        records, all_f0, all_f1, all_i0, all_i1, all_i2 = passes.gather(
            part_f_ptr, part_i_ptr, row, splits, split_ids, split_mask, rounds, NT, WIDTH
        )
        drew = (kind == DRAW) | ((kind == STATS) & (drawing == 1))

        # The row's next state.
        if kind == STATS:
            row_max, token, z_dom, min_key, num_finite = passes.reduce_stats(all_f0, all_f1, all_i0, all_i1, all_i2)
            # Every finite token is in play: a search starts over (the smallest key - 1, the largest].
            tau = min_key
            hi = passes.key_of(row_max).to(tl.int64)
            lo = min_key.to(tl.int64) - 1
            mass_lo = z_dom
            count_lo = num_finite
            count_hi = 0
            mass_hi = 0.0
            listed = 0
            search_passes = 0
            limit = top_p * z_dom
            kind = passes.state_after_stats(greedy, drawing, top_k, num_finite, top_p)
        elif kind == CHECK:
            kind, tau, lo, mass_lo, count_lo, drawing, checks = passes.check_candidate(
                kind, tau, limit, lo, mass_lo, count_lo, drawing, checks, key_c, all_f1, all_i2, MAX_DRAWS
            )
        elif kind != DRAW:
            search_passes, lo, hi, mass_lo, count_lo, count_hi, mass_hi, listed = passes.narrow_search(
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
                NT,
                MAX_PASSES,
            )
        kind, search_passes, tau, z_dom, limit, hi, count_hi, mass_hi, listed = passes.end_search(
            top_p, kind, search_passes, row_max, tau, z_dom, limit, lo, hi, mass_lo, count_hi, mass_hi, listed
        )
        if drew:
            kind, token, tau, num_kept, key_c = passes.take_draw(
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
                NT,
            )

    passes.finish(
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
        WRITE_NUM_KEPT,
        WRITE_NUM_PASSES,
    )


# The parameter pointers are slices of one host->device copy whose offsets depend on the batch size:
# left specialised on alignment they would compile a variant per batch size modulo 4.
_sample = lazy_jit(
    _sample_kernel,
    do_not_specialize=("temperature_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seed_ptr", "vocab_size", "chunk"),
)

# One int32 per row, per device: zero between launches (the kernel leaves them so); launches sharing
# them must be ordered, i.e. issued on one stream.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_NUM_SMS: dict[torch.device, int] = {}
# Programs of one compiled variant that an SM holds at once, learnt from its first launch.
_RESIDENT_PER_SM: dict[tuple[torch.device, tuple], int] = {}


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seeds: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    num_kept: torch.Tensor | None = None,
    num_passes: torch.Tensor | None = None,
    config: SamplingConfig | None = None,
) -> torch.Tensor:
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
    variant = (
        config,
        top_k is not None,
        top_p is not None,
        min_p is not None,
        num_kept is not None,
        num_passes is not None,
    )
    splits = _splits(device, num_rows, vocab_size, config, variant)
    chunk = -(-vocab_size // (splits * config.block)) * config.block
    splits = -(-vocab_size // chunk)
    part_f = torch.empty(num_rows * 2 * splits * RECORD_WIDTH, dtype=torch.float32, device=device)
    part_i = torch.empty(num_rows * 2 * splits * RECORD_WIDTH, dtype=torch.int32, device=device)
    candidates = torch.empty(max(1, num_rows * splits * config.list_capacity), dtype=torch.int32, device=device)
    kernel = _sample[(splits, num_rows)](
        logits,
        logits.stride(0),
        temperature,
        top_k if top_k is not None else seeds,
        top_p if top_p is not None else temperature,
        min_p if min_p is not None else temperature,
        seeds,
        token_ids,
        num_kept if num_kept is not None else part_i,
        num_passes if num_passes is not None else part_i,
        part_f,
        part_i,
        _counters(device, num_rows),
        candidates,
        vocab_size,
        chunk,
        BLOCK=config.block,
        SEARCH_BLOCK=config.search_block,
        NT=config.num_thresholds,
        WIDTH=RECORD_WIDTH,
        SPLITS_P2=MAX_SPLITS,
        VALUE_PASSES=config.value_passes,
        MAX_PASSES=config.max_passes,
        PREFETCH=config.prefetch,
        LIST_CAP=config.list_capacity,
        HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None,
        HAS_MIN_P=min_p is not None,
        MAX_DRAWS=config.max_draws,
        WRITE_NUM_KEPT=num_kept is not None,
        WRITE_NUM_PASSES=num_passes is not None,
        # One num_warps per config: each value is a variant to compile (and warm up).
        num_warps=config.num_warps,
        maxnreg=config.max_registers,
    )
    if (device, variant) not in _RESIDENT_PER_SM and getattr(kernel, "n_regs", None) is not None:
        _RESIDENT_PER_SM[device, variant] = _resident_per_sm(
            device, kernel.n_regs, kernel.metadata.shared, config.num_warps
        )
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


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    *,
    seeds: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
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


def kept_mask_reference(
    x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
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
