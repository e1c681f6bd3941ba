"""Programmatic dependent launch (launch.pdl_options): when it is on, and that chained kernels still
see each other's results (eager and inside a CUDA graph) exactly as with plain stream ordering."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels import configs
from gpuworker.kernels.attention.paged_decode import paged_decode_attention
from gpuworker.kernels.launch import pdl_options
from gpuworker.kernels.linear.gemv import gemv, pick_config
from gpuworker.kernels.norm.rms_norm import rms_norm

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_without_cuda():
    assert pdl_options(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("GPUWORKER_PDL", "0")
    assert pdl_options(torch.device("cuda")) == {"USE_PDL": False}


def _chain(x, weights, norm_weight):
    # Each kernel reads what the one before it wrote: a missing wait would read stale data.
    for weight in weights:
        x = gemv(rms_norm(x, norm_weight, 1e-5), weight)
    return x


@pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs compute capability 9.0+")
@pytest.mark.parametrize("in_graph", [False, True])
def test_chained_kernels_match_plain_launches(monkeypatch, in_graph):
    assert pdl_options(torch.device("cuda"))["USE_PDL"]
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(4096, 4096, generator=generator) / 64).to(torch.bfloat16).cuda() for _ in range(24)]
    norm_weight = torch.randn(4096, generator=generator).to(torch.bfloat16).cuda()
    x = torch.randn(1, 4096, generator=generator).to(torch.bfloat16).cuda()

    monkeypatch.setenv("GPUWORKER_PDL", "0")
    expected = _chain(x, weights, norm_weight)
    monkeypatch.setenv("GPUWORKER_PDL", "1")
    if in_graph:
        _chain(x, weights, norm_weight)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = _chain(x, weights, norm_weight)
        graph.replay()
    else:
        got = _chain(x, weights, norm_weight)
    torch.cuda.synchronize()
    assert torch.equal(got, expected)


@pytest.mark.skipif(not ON_HOPPER, reason="programmatic dependent launch needs compute capability 9.0+")
@pytest.mark.parametrize("in_graph", [False, True])
def test_attention_then_prefetching_gemv_match_plain_launches(monkeypatch, in_graph, paged_cache):
    # As in a layer at batch 1: the decode kernel and its merge let the next kernel launch before
    # they wait, and the o_proj-shaped GEMV loads its first weight tiles before its own wait. Each
    # attention takes its query from the GEMV before it, each GEMV its input from the merge. With the
    # H200's tables, whose o_proj config prefetches, on whichever Hopper GPU runs the test.
    monkeypatch.setattr(configs, "device_name", lambda device=None: "NVIDIA H200")
    assert pdl_options(torch.device("cuda"))["USE_PDL"]
    assert pick_config(1, 4096, 4096).prefetch, "the o_proj config is the one that prefetches"
    generator = torch.Generator().manual_seed(0)
    heads, head_dim = 32, 128
    kv_cache, block_tables = paged_cache([700], 8, head_dim, 16, torch.bfloat16, generator, table_width=512)
    seq_lens = torch.tensor([700], dtype=torch.int32, device="cuda")
    weights = [(torch.randn(4096, 4096, generator=generator) / 64).to(torch.bfloat16).cuda() for _ in range(12)]
    x = torch.randn(1, 4096, generator=generator).to(torch.bfloat16).cuda()

    def chain(x):
        for weight in weights:
            # Captured for 8192 tokens as the engine does: split, merged by the second kernel.
            attended = paged_decode_attention(
                x.view(1, heads, head_dim), kv_cache, block_tables, seq_lens, head_dim**-0.5, 8192
            )
            x = gemv(attended.view(1, heads * head_dim), weight)
        return x

    monkeypatch.setenv("GPUWORKER_PDL", "0")
    expected = chain(x)
    monkeypatch.setenv("GPUWORKER_PDL", "1")
    if in_graph:
        chain(x)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(x)
        graph.replay()
    else:
        got = chain(x)
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
