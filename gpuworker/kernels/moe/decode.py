"""The MoE experts for a few tokens (decode): routing, gate/up and down in three launches, no grouping.

At batch 1 the grouped path (kernels.fused_moe) spends more time sorting and padding 8 (token,
expert) pairs with a dozen small torch kernels than reading the experts, and its gate/up grid (a
block of 16 rows per expert, 8 of them busy) leaves most SMs idle. Here, for at most
DECODE_MAX_PAIRS pairs: one program per token routes (softmax over the router logits, top_k,
renormalised when the family does: `route_reference`); the gate/up kernel runs one program per
(pair, BLOCK_N rows of the intermediate), reading the pair's expert id itself, a GEMV along
contiguous weight rows with SiLU-and-mul fused; the down kernel runs one program per (token,
BLOCK_N rows of the hidden) over the token's top_k pairs and sums their weighted outputs in a fixed
order (deterministic, no atomics, no reduce launch). Shapes depend only on the token count, nothing
is read on the host: the three launches are captured in the decode CUDA graphs.

Tiles come from the device's table (configs/moe_decode/, which bench/moe_decode.py writes) or the
GPUWORKER_MOE_DECODE environment variable; rounding follows fused_moe (each projection rounded to the
activation dtype, each pair's weighted output rounded, the top_k of them summed in float32).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpuworker.kernels import configs
from gpuworker.kernels.launch import FLOAT_DTYPES, check_tensor, lazy_jit, next_power_of_2, pdl_options
from gpuworker.kernels.moe.fused import check_experts

# Above this many (token, expert) pairs the grouped kernels win: a pair reads its expert's weights
# on its own here, so many tokens sharing experts would read them many times over.
DECODE_MAX_PAIRS = 64
ENV_OVERRIDE = "GPUWORKER_MOE_DECODE"


@dataclass(frozen=True)
class Tile:
    """One kernel's tile: BLOCK_N output rows per program, BLOCK_K of the reduction per step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"n{self.block_n}-k{self.block_k}-w{self.num_warps}-p{self.num_stages}"

    @classmethod
    def parse(cls, name: str) -> Tile:
        match = re.fullmatch(r"n(\d+)-k(\d+)-w(\d+)-p(\d+)", name.strip())
        if match is None:
            raise ValueError(f"a tile is written n<BLOCK_N>-k<BLOCK_K>-w<warps>-p<stages>, got {name!r}")
        tile = cls(*(int(g) for g in match.groups()))
        for field in ("block_n", "block_k", "num_warps"):
            value = getattr(tile, field)
            if value < 1 or value & (value - 1):
                raise ValueError(f"tile {name!r}: {field} must be a positive power of 2, got {value}")
        if tile.num_stages < 1:
            raise ValueError(f"tile {name!r}: num_stages must be >= 1")
        return tile


@dataclass(frozen=True)
class DecodeConfig:
    gate_up: Tile
    down: Tile

    @property
    def name(self) -> str:
        return f"gate_up={self.gate_up.name},down={self.down.name}"

    @classmethod
    def parse(cls, name: str) -> DecodeConfig:
        parts = dict(part.split("=", 1) for part in name.split(",") if "=" in part)
        if set(parts) != {"gate_up", "down"} or len(name.split(",")) != 2:
            raise ValueError(f"a decode config is written gate_up=<tile>,down=<tile>, got {name!r}")
        return cls(Tile.parse(parts["gate_up"]), Tile.parse(parts["down"]))


# Gate/up: 384 programs at Qwen3-30B-A3B's batch 1 (8 pairs x 768 / 16), about 3 per SM on an H200.
# Down: 256 programs (2048 / 8), each summing the token's 8 experts.
DEFAULT_CONFIG = DecodeConfig(gate_up=Tile(16, 256, 4, 3), down=Tile(8, 256, 4, 3))
GROUPED = "grouped"
# The choices measured on each device: configs/moe_decode/<device>.json, {(hidden, expert intermediate,
# top_k, token bucket): config name, or GROUPED for the grouped kernels} from bench/moe_decode.py;
# buckets 1, 2, 4, 8, ... (the count rounded up to a power of 2). A device, shape or bucket without a
# record takes DEFAULT_CONFIG up to DECODE_MAX_PAIRS pairs.
TABLE_KEY = ("hidden", "inter", "top_k", "tokens")


def decode_config(
    num_tokens: int, top_k: int, hidden: int, inter: int, device: torch.device | None = None
) -> DecodeConfig | None:
    """The decode path's tiles for this many tokens on `device` (None: the current one), or None where
    the grouped kernels should run.

    GPUWORKER_MOE_DECODE overrides the table for every shape: a config name (gate_up=<tile>,down=<tile>)
    for every count up to DECODE_MAX_PAIRS pairs, or "grouped" to turn the decode path off."""
    if num_tokens < 1 or num_tokens * top_k > DECODE_MAX_PAIRS:
        return None
    name = os.environ.get(ENV_OVERRIDE)
    if not name:
        table = configs.table("moe_decode", TABLE_KEY, device)
        record = table.get((hidden, inter, top_k, next_power_of_2(num_tokens)))
        name = None if record is None else record["config"]
    if name is None:
        return DEFAULT_CONFIG
    if name.strip() == GROUPED:
        return None
    return DecodeConfig.parse(name)


def route_reference(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, top_k] float32, expert ids [T, top_k] int64): softmax over
    all experts in float32, the top_k, renormalised over them when `normalize` (Mixtral's softmax
    over its top_k logits is the same thing). The CPU path, and the reference of route_top_k."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_decode_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """moe_decode in torch, pair by pair with the kernels' rounding: each projection rounded to x's
    dtype, each pair's weighted output rounded, a token's pairs summed in float32. Choices of
    experts outside first_expert..first_expert+E-1 add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for token in range(x.shape[0]):
        for choice in range(ids.shape[1]):
            local = int(ids[token, choice]) - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            gate, up = (x[token].float() @ w13[local].float().t()).to(x.dtype).split(inter)
            act = (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
            down = (act.float() @ w2[local].float().t()).to(x.dtype)
            out[token] += (down.float() * weights[token, choice]).to(x.dtype).float()
    return out.to(x.dtype)


def _route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_l,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    NORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # see launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_l + experts, mask=experts < NUM_EXPERTS, other=float("-inf")).to(
        tl.float32
    )
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    # The top_k by logit, the first index on ties: the softmax keeps the logits' order, and comparing
    # logits leaves out ties that only its rounding would make. NaN logits (a broken model) can make
    # the index BLOCK_E, past every rank's experts: the experts kernels skip it, nothing is read out
    # of bounds.
    taken = experts >= NUM_EXPERTS
    slots = tl.arange(0, BLOCK_TOP_K)
    chosen_weights = tl.zeros([BLOCK_TOP_K], dtype=tl.float32)
    chosen_ids = tl.zeros([BLOCK_TOP_K], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), logits), axis=0)
        index = tl.min(tl.where(~taken & (logits == best), experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == index, probs, 0.0), axis=0)
        chosen_weights = tl.where(slots == k, weight, chosen_weights)
        chosen_ids = tl.where(slots == k, index.to(tl.int64), chosen_ids)
        taken = taken | (experts == index)
    if NORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def _gate_up_kernel(
    x_ptr,
    w13_ptr,
    ids_ptr,
    act_ptr,
    stride_x,
    stride_we,
    stride_wn,
    first_expert,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    token = pair // TOP_K
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    expert = tl.load(ids_ptr + pair) - first_expert
    if (expert < 0) | (expert >= NUM_EXPERTS):  # another rank's expert: the down kernel skips the pair
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past INTER read row INTER-1 instead of being masked, so weight loads stay wide; only the
    # store is masked.
    gate_rows = w13_ptr + expert * stride_we + tl.minimum(rows, INTER - 1).to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    # Elementwise accumulation along K, one cross-thread reduction after the loop (gemv's FMA path).
    gate_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for tile in tl.range(0, tl.cdiv(HIDDEN, BLOCK_K), num_stages=NUM_STAGES):
        ks = tile * BLOCK_K + offs_k
        if EVEN_K:
            x = tl.load(x_ptr + token * stride_x + ks, eviction_policy="evict_last")
            w_gate = tl.load(gate_rows + ks[None, :], eviction_policy="evict_first")
            w_up = tl.load(up_rows + ks[None, :], eviction_policy="evict_first")
        else:
            x = tl.load(x_ptr + token * stride_x + ks, mask=ks < HIDDEN, other=0.0, eviction_policy="evict_last")
            w_gate = tl.load(
                gate_rows + ks[None, :], mask=ks[None, :] < HIDDEN, other=0.0, eviction_policy="evict_first"
            )
            w_up = tl.load(up_rows + ks[None, :], mask=ks[None, :] < HIDDEN, other=0.0, eviction_policy="evict_first")
        x32 = x.to(tl.float32)[None, :]
        gate_acc += w_gate.to(tl.float32) * x32
        up_acc += w_up.to(tl.float32) * x32
    dtype = act_ptr.dtype.element_ty
    gate = tl.sum(gate_acc, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(up_acc, axis=1).to(dtype).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(act_ptr + pair * INTER + rows, (activated * up).to(dtype), mask=rows < INTER)


def _down_kernel(
    act_ptr,
    w2_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    stride_we,
    stride_wn,
    stride_o,
    first_expert,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_offsets = tl.minimum(rows, HIDDEN - 1).to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    k_tiles = (INTER + BLOCK_K - 1) // BLOCK_K  # constexpr arithmetic: a constant
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    # One loop over the token's pairs and their K tiles, so the loads stay pipelined from one expert
    # to the next (a loop per expert would wait for memory at each one's start); pairs in top_k order,
    # as fused_moe sums them. Another rank's expert is read as nothing (masked) and adds nothing.
    for step in tl.range(0, TOP_K * k_tiles, num_stages=NUM_STAGES):
        choice = step // k_tiles
        tile = step - choice * k_tiles
        pair = token * TOP_K + choice
        expert = tl.load(ids_ptr + pair) - first_expert
        local = (expert >= 0) & (expert < NUM_EXPERTS)
        w_rows = w2_ptr + tl.where(local, expert, 0) * stride_we + row_offsets
        ks = tile * BLOCK_K + offs_k
        k_mask = tl.where(local, ks < INTER, False)  # (ks < INTER) & local: the interpreter makes that int32
        a = tl.load(act_ptr + pair * INTER + ks, mask=k_mask, other=0.0, eviction_policy="evict_last")
        w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
        if tile == k_tiles - 1:  # the pair's projection is complete: weight it, round it, add it
            projected = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
            weight = tl.load(weights_ptr + pair)
            total += tl.where(local, (projected * weight).to(dtype).to(tl.float32), 0.0)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    tl.store(out_ptr + token * stride_o + rows, total.to(dtype), mask=rows < HIDDEN)


_route = lazy_jit(_route_kernel)
# first_expert is a rank's offset (0 on one GPU): a value that must not pick a variant.
_gate_up = lazy_jit(_gate_up_kernel, do_not_specialize=("first_expert",))
_down = lazy_jit(_down_kernel, do_not_specialize=("first_expert",))


def route_top_k(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """route_reference in one launch: router_logits [T, E] -> (weights [T, top_k] float32, ids [T,
    top_k] int64), the top_k in descending order, the lower expert first on equal logits."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_experts = router_logits.shape
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in 1..{num_experts} (the experts), got {top_k!r}")
    if router_logits.stride(1) != 1:
        raise ValueError("router_logits needs a contiguous last dimension")
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens:
        _route[(num_tokens,)](
            router_logits,
            weights,
            ids,
            router_logits.stride(0),
            NUM_EXPERTS=num_experts,
            TOP_K=top_k,
            BLOCK_E=next_power_of_2(num_experts),
            BLOCK_TOP_K=next_power_of_2(top_k),
            NORMALIZE=bool(normalize),
            num_warps=1 if num_experts <= 128 else 4,
            **pdl_options(device),
        )
    return weights, ids


def moe_decode(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first_expert: int = 0,
    *,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """fused_moe's result (same arguments: x [T, H], w13 [E, 2I, H], w2 [E, H, I] of experts
    first_expert.., weights [T, top_k] float32, ids [T, top_k] int64 global ids) in two launches
    without grouping, for a few tokens (moe_decode_reference). `config` defaults to decode_config's,
    else DEFAULT_CONFIG."""
    num_tokens, hidden, num_experts, inter, top_k = check_experts(x, w13, w2, weights, ids)
    if config is None:
        config = decode_config(num_tokens, top_k, hidden, inter, x.device) or DEFAULT_CONFIG
    device = x.device
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    weights, ids = weights.contiguous(), ids.contiguous()
    pdl = pdl_options(device)
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=device)
    gate_up, down = config.gate_up, config.down
    _gate_up[(num_tokens * top_k, triton.cdiv(inter, gate_up.block_n))](
        x,
        w13,
        ids,
        act,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        first_expert,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_N=gate_up.block_n,
        BLOCK_K=gate_up.block_k,
        NUM_STAGES=gate_up.num_stages,
        EVEN_K=hidden % gate_up.block_k == 0,
        num_warps=gate_up.num_warps,
        num_stages=gate_up.num_stages,
        **pdl,
    )
    _down[(num_tokens, triton.cdiv(hidden, down.block_n))](
        act,
        w2,
        ids,
        weights,
        out,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        first_expert,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        HIDDEN=hidden,
        INTER=inter,
        BLOCK_N=down.block_n,
        BLOCK_K=down.block_k,
        NUM_STAGES=down.num_stages,
        num_warps=down.num_warps,
        num_stages=down.num_stages,
        **pdl,
    )
    return out
