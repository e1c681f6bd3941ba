"""Programmatic dependent launch (launch.pdl_options): when it is on, and that chained kernels still
see each other's results (eager and inside a CUDA graph) exactly as with plain stream ordering."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.gemv import gemv
from gpuworker.kernels.launch import pdl_options
from gpuworker.kernels.rms_norm import rms_norm

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
