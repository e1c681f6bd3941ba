"""Gemma 3 on the Triton attention backend against the torch backend: sliding layers through the
decode kernel (its new token rotated and cached in the launch) and the prefill kernel with their
window, steps crossing the window, logits and caches equal."""

from __future__ import annotations

import dataclasses

import torch

from gpuworker.attention.torch_backend import TorchAttentionBackend
from gpuworker.attention.triton_backend import TritonAttentionBackend
from gpuworker.models.loader import load_model, load_model_config
from tests.gpuworker.checkpoints import FAMILIES, make_checkpoint
from tests.gpuworker.models.paged_batch import PagedBatcher

WINDOW = FAMILIES["gemma3"][1]["sliding_window"]


def _on(meta, device):
    tensors = {
        field.name: getattr(meta, field.name).to(device)
        for field in dataclasses.fields(meta)
        if isinstance(getattr(meta, field.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **tensors)


def test_gemma3_on_triton_backend_matches_torch_backend(tmp_path, device):
    mc = load_model_config(make_checkpoint(tmp_path, "gemma3"))
    devices = {"triton": device, "torch": "cpu"}
    models = {
        backend.name: load_model(mc, device=devices[backend.name], dtype=torch.float32, attn_backend=backend)
        for backend in (TritonAttentionBackend(), TorchAttentionBackend())
    }
    batchers = {name: PagedBatcher(mc) for name in models}
    batchers["triton"].kv_caches = [cache.to(device) for cache in batchers["triton"].kv_caches]
    steps = [
        ([("a", list(range(3, 50))), ("b", list(range(50, 55)))], None),  # a: past the window
        ([("a", [7]), ("b", [8])], 4),
        ([("a", [9]), ("b", list(range(60, 90)))], 3),  # b's chunk crosses the window
        ([("a", [11]), ("b", [12])], None),
    ]
    assert max(len(tokens) for chunks, _ in steps for _, tokens in chunks) > WINDOW
    for chunks, pad_to in steps:
        logits = {}
        for name, model in models.items():
            input_ids, positions, meta = batchers[name].batch(chunks, pad_to=pad_to)
            with torch.no_grad():
                hidden = model(
                    input_ids.to(devices[name]),
                    positions.to(devices[name]),
                    batchers[name].kv_caches,
                    _on(meta, devices[name]),
                )
                logits[name] = model.compute_logits(hidden).cpu()
        torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    for triton_cache, torch_cache in zip(batchers["triton"].kv_caches, batchers["torch"].kv_caches, strict=True):
        torch.testing.assert_close(triton_cache.cpu(), torch_cache, rtol=1e-5, atol=1e-5)
