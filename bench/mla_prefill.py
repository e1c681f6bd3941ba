"""MLA prefill benchmark and tile sweep: a step's prefill attention of multi-head latent attention at
DeepSeek-V2-Lite's (16 heads) and DeepSeek-V3's (128 heads) shapes (kv_lora_rank 512, keys 128 + 64,
values 128), bf16, on one GPU; the per-sequence loop against the batched path.

    PYTHONPATH=. python bench/mla_prefill.py [--quick] [--write-configs]
    PYTHONPATH=. python bench/mla_prefill.py --check-only    # no timing; on a CPU: tiny shapes, float32,
                                                             # the Triton interpreter

Per workload (a batch of whole prompts of 100 to 1024 tokens, as the 512-request run's prefill steps
hold, and chunks of 512 at the end of 2048-token contexts, as chunked prefill and prefix-cache hits
give) and head count, one layer's prefill from the paged latent cache is timed two ways, as Python
issues it (wall time per call, launch overhead included, as a step without graphs pays it):
  loop     per sequence: gather its latents, kv_b_proj, build keys, torch SDPA (the former path);
  batched  one gather of every sequence's rows, one kv_b_proj GEMM, one Triton MLA prefill launch
           (MLAttention._prefill on the triton backend).
The kernel alone (the context gathered and expanded once) is then timed per candidate tile (CUDA
graph replays); every candidate is first
checked against mla_prefill_attention_reference. The tile with the lowest geometric mean wins;
--write-configs merges it into gpuworker/kernels/configs/mla_prefill/<this GPU>.json, which the
kernel reads at run time. Writes mla_prefill.json (mla_prefill_check.json with --check-only) to $OUT
(or bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from common import add_write_configs_option, pick_tile, start_kernel_sweep, write_configs, write_json

SHAPE = {"kv_rank": 512, "nope": 128, "rope": 64, "v_dim": 128}
HEADS = (16, 128)  # DeepSeek-V2-Lite, DeepSeek-V3
BLOCK_SIZE = 16
# Tiny shapes for --check-only on a CPU.
TINY_SHAPE = {"kv_rank": 32, "nope": 32, "rope": 16, "v_dim": 24}
TINY_HEADS = (2, 5)


def workloads(device: str) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (chunk lengths, context lengths) of one step's prefill sequences."""
    generator = torch.Generator().manual_seed(0)
    if device != "cuda":
        return {"prompts": ([7, 19, 1], [7, 19, 1]), "chunks": ([5, 16], [40, 33])}
    prompts = torch.randint(100, 1025, (12,), generator=generator).tolist()
    return {"prompts": (prompts, prompts), "chunks": ([512] * 4, [2048] * 4)}


def candidates(quick: bool) -> list:
    from gpuworker.kernels.attention.mla_prefill import DEFAULT_CONFIG, MLAPrefillConfig

    tiles = [DEFAULT_CONFIG]
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for num_warps, num_stages in ((4, 2), (8, 2), (4, 3), (8, 3)):
                tile = MLAPrefillConfig(block_m, block_n, num_warps, num_stages)
                if tile not in tiles:
                    tiles.append(tile)
    if quick:
        return tiles[:: max(1, len(tiles) // 8)]
    return tiles


def name(tile) -> str:
    return f"m{tile.block_m}-n{tile.block_n}-w{tile.num_warps}-p{tile.num_stages}"


@dataclasses.dataclass
class Layer:
    """One layer's prefill step: its latent cache and kv_b_proj, the chunks' queries, the metadata."""

    cache: torch.Tensor  # [blocks, block_size, kv_rank + rope]
    kv_b: torch.Tensor  # [heads * (nope + v_dim), kv_rank]
    q_nope: torch.Tensor
    q_rope: torch.Tensor
    meta: object  # AttentionMetadata
    heads: int
    shape: dict


def make_layer(q_lens, seq_lens, heads, shape, dtype, device) -> Layer:
    from gpuworker.attention.backend import AttentionMetadata

    generator = torch.Generator(device=device).manual_seed(heads + sum(seq_lens))
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    width = shape["kv_rank"] + shape["rope"]
    cache = torch.randn(sum(blocks) + 1, BLOCK_SIZE, width, device=device, generator=generator).to(dtype)
    order = torch.randperm(sum(blocks), device=device, generator=generator).int() + 1
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    for i, (taken, n) in enumerate(zip([0, *torch.tensor(blocks).cumsum(0).tolist()], blocks)):
        tables[i, :n] = order[taken : taken + n]
    kv_b = torch.randn(heads * (shape["nope"] + shape["v_dim"]), shape["kv_rank"], device=device, generator=generator)
    kv_b = (kv_b / math.sqrt(shape["kv_rank"])).to(dtype)
    q = torch.randn(sum(q_lens), heads, shape["nope"] + shape["rope"], device=device, generator=generator).to(dtype)
    q_nope, q_rope = q.split([shape["nope"], shape["rope"]], dim=-1)
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        num_decode_seqs=0,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    return Layer(cache, kv_b, q_nope, q_rope.contiguous(), meta, heads, shape)


def expand(layer: Layer, rows: torch.Tensor):
    """(k_nope, k_rope, values) of context rows [S, kv_rank + rope]: kv_b_proj, the rotary key shared."""
    s = layer.shape
    latent, k_pe = rows.split([s["kv_rank"], s["rope"]], dim=-1)
    kv = (latent @ layer.kv_b.t()).view(rows.shape[0], layer.heads, s["nope"] + s["v_dim"])
    k_nope, values = kv.split([s["nope"], s["v_dim"]], dim=-1)
    return k_nope, k_pe[:, None, :].expand(-1, layer.heads, -1), values


def looped(layer: Layer, out: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather its latents, expand them, torch SDPA (fused on a GPU, float32 on a CPU)."""
    from gpuworker.models.deepseek.attention import attend_expanded

    rows = layer.cache.view(-1, layer.cache.shape[-1])
    offsets = torch.arange(BLOCK_SIZE, device=rows.device)
    qsl, meta = layer.meta.query_start_loc_cpu, layer.meta
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        blocks = meta.block_tables[i, : -(-seq_len // BLOCK_SIZE)].long()
        context = rows[(blocks[:, None] * BLOCK_SIZE + offsets[None, :]).reshape(-1)[:seq_len]]
        k_nope, k_rope, values = expand(layer, context)
        keys = torch.cat((k_nope, k_rope), dim=-1)
        query = torch.cat((layer.q_nope[qsl[i] : qsl[i + 1]], layer.q_rope[qsl[i] : qsl[i + 1]]), dim=-1)
        out[qsl[i] : qsl[i + 1]] = attend_expanded(query, keys, values, scale, fused=query.is_cuda)
    return out


def gathered(layer: Layer):
    """(k_nope, k_rope, values, cu_seqlens_k): one gather of every sequence's rows (MLAttention's
    context_slots) and one kv_b_proj GEMM."""
    from gpuworker.models.deepseek.attention import context_slots

    meta = layer.meta
    slots, cu_seqlens_k = context_slots(meta, 0, meta.num_seqs, BLOCK_SIZE, sum(meta.seq_lens_cpu))
    return (*expand(layer, layer.cache.view(-1, layer.cache.shape[-1])[slots]), cu_seqlens_k)


def attend(layer: Layer, context, out: torch.Tensor, scale: float, tile=None) -> torch.Tensor:
    """One Triton MLA prefill launch over the gathered context."""
    from gpuworker.kernels.attention.mla_prefill import mla_prefill_attention

    k_nope, k_rope, values, cu_seqlens_k = context
    meta = layer.meta
    return mla_prefill_attention(
        layer.q_nope,
        layer.q_rope,
        k_nope,
        k_rope,
        values,
        meta.query_start_loc,
        cu_seqlens_k,
        meta.max_query_len,
        scale,
        out=out,
        config=tile,
    )


def batched(layer: Layer, out: torch.Tensor, scale: float) -> torch.Tensor:
    return attend(layer, gathered(layer), out, scale)


def reference(layer: Layer, scale: float) -> torch.Tensor:
    from gpuworker.kernels.attention.mla_prefill import mla_prefill_attention_reference

    k_nope, k_rope, values, cu_seqlens_k = gathered(layer)
    meta = layer.meta
    return mla_prefill_attention_reference(
        layer.q_nope, layer.q_rope, k_nope, k_rope, values, meta.query_start_loc_cpu, cu_seqlens_k.tolist(), scale
    )


def measure(layer: Layer, workload: str, tiles: list, *, timed: bool) -> tuple[dict, list[dict]]:
    """(the loop-against-batched row, one row per tile) of one layer."""
    scale = 1 / math.sqrt(layer.shape["nope"] + layer.shape["rope"])
    context = gathered(layer)
    expected = reference(layer, scale).float()
    tolerance = 1e-4 if expected.dtype == layer.q_nope.dtype == torch.float32 else 3e-2
    out = torch.zeros_like(expected).to(layer.q_nope.dtype)
    shape = {"workload": workload, "heads": layer.heads, "num_seqs": len(layer.meta.seq_lens_cpu)}
    shape["tokens"], shape["context"] = layer.q_nope.shape[0], sum(layer.meta.seq_lens_cpu)
    loop_err = (looped(layer, out, scale).float() - expected).abs().max().item()
    compare = {**shape, "loop_max_abs_err": loop_err, "ok": loop_err < tolerance}
    rows = []
    for tile in tiles:
        err = (attend(layer, context, out, scale, tile).float() - expected).abs().max().item()
        row = {**shape, "config": name(tile), "max_abs_err": err, "ok": err < tolerance}
        if not row["ok"]:
            print(f"  {workload} h{layer.heads} {name(tile)}: FAILED, max abs error {err:.3g}")
        elif timed:
            from kernel_times import graph_time_us

            row["kernel_us"] = graph_time_us([lambda t=tile: attend(layer, context, out, scale, t)])
        rows.append(row)
    if timed:
        from kernel_times import eager_time_us

        compare["loop_us"] = eager_time_us(lambda: looped(layer, out, scale), iters=20)
        compare["batched_us"] = eager_time_us(lambda: batched(layer, out, scale), iters=20)
        compare["speedup"] = compare["loop_us"] / compare["batched_us"]
        print(
            f"  {workload:8s} heads {layer.heads:3d}: loop {compare['loop_us']:9.1f} us  "
            f"batched {compare['batched_us']:9.1f} us  ({compare['speedup']:.1f}x)"
        )
    return compare, rows


def config_records(best: str, tiles: list, dtype: str = "bfloat16") -> list[dict]:
    tile = next(t for t in tiles if name(t) == best)
    record = {
        "dtype": dtype,
        "nope_dim": SHAPE["nope"],
        "rope_dim": SHAPE["rope"],
        "v_dim": SHAPE["v_dim"],
        **dataclasses.asdict(tile),
    }
    return [{**record, "note": "DeepSeek-V2-Lite and V3 prefill, whole prompts and chunks after a prefix"}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check-only", action="store_true", help="check every tile against the reference, no timing")
    parser.add_argument("--quick", action="store_true", help="about eight tiles instead of the whole sweep")
    add_write_configs_option(parser, "gpuworker/kernels/configs/mla_prefill")
    args = parser.parse_args()
    sweep = start_kernel_sweep("mla_prefill.py", args.check_only, copy_bandwidth=False)
    device, timed = sweep.device, sweep.timed
    if args.write_configs and not timed:
        raise SystemExit("--write-configs needs a timed run on a GPU")
    dtype, shape, heads = (
        (torch.bfloat16, SHAPE, HEADS) if device == "cuda" else (torch.float32, TINY_SHAPE, TINY_HEADS)
    )
    tiles = candidates(args.quick)
    comparisons, results = [], []
    for workload, (q_lens, seq_lens) in workloads(device).items():
        for num_heads in heads:
            layer = make_layer(q_lens, seq_lens, num_heads, shape, dtype, device)
            compare, rows = measure(layer, workload, tiles, timed=timed)
            comparisons.append(compare)
            results.extend(rows)
            del layer
    best = pick_tile(results, "kernel_us") if timed else None
    if best is not None:
        print(f"best tile: {best}")
    payload = {
        "timed": timed,
        "env": sweep.env,
        "dtype": str(dtype),
        "best_config": best,
        "comparisons": comparisons,
        "results": results,
    }
    write_json("mla_prefill" if timed else "mla_prefill_check", payload)
    if args.write_configs and best is not None:
        from gpuworker.kernels.attention.mla_prefill import KERNEL, TABLE_KEY

        write_configs(KERNEL, TABLE_KEY, config_records(best, tiles))


if __name__ == "__main__":
    main()
