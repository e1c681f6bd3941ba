"""Kernel launches over a run whose batch shapes change every step keep one Triton specialisation.

Triton compiles a variant of a kernel per pattern of "pointer 16-byte aligned", "integer == 1" and
"integer divisible by 16" among its non-constexpr arguments (those not marked do_not_specialize).
On the GPU each new pattern costs about a second of compilation in the middle of serving; on an
H200 an offline run spent 9 s of 59 compiling them. This drives the engine with the Triton backend
(under the interpreter here, compiled on a GPU) through prefills, chunked prefills, mixed and
decode steps of varying sizes and checks that every kernel saw a single pattern.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import triton.language as tl

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.attention_triton import TritonAttentionBackend
from gpuworker.kernels.launch import LazyJIT
from tests.gpuworker.checkpoints import TINY, make_checkpoint
from tests.gpuworker.engine.reference import random_prompts


def _pattern(lazy: LazyJIT, args: tuple, kwargs: dict) -> tuple:
    signature = inspect.signature(lazy.fn)
    # Launch options (num_warps, num_stages) are not kernel parameters.
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    pattern = []
    for name, value in bound.arguments.items():
        if signature.parameters[name].annotation in (tl.constexpr, "tl.constexpr") or name in lazy.do_not_specialize:
            continue
        if isinstance(value, torch.Tensor):
            pattern.append((name, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            pattern.append((name, value == 1, value % 16 == 0))
    return tuple(pattern)


def test_one_specialisation_per_kernel_across_changing_batches(tmp_path, monkeypatch):
    patterns: dict[str, set[tuple]] = defaultdict(set)
    getitem = LazyJIT.__getitem__

    def recording(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            patterns[self.fn.__name__].add(_pattern(self, args, kwargs))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(LazyJIT, "__getitem__", recording)
    path = make_checkpoint(tmp_path, "llama")
    engine = LLMEngine(path, attn_backend=TritonAttentionBackend(), num_kv_blocks=128, max_model_len=256,
                       block_size=4, max_num_batched_tokens=29)
    # Odd lengths and a small token budget: chunked prefills, mixed steps and decode batches of many
    # sizes, block tables of many widths.
    prompts = random_prompts((3, 27, 5, 40, 9, 18, 33, 2, 11), TINY["vocab_size"])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 5, 12, 7, 20, 4, 15)]
    engine.generate(prompts, params)
    assert {"_prefill_attention_kernel", "_paged_decode_kernel", "_rotary_kernel"} <= set(patterns)
    varied = {name: sorted(seen) for name, seen in patterns.items() if len(seen) > 1}
    assert not varied, f"kernels compiled in several variants: {varied}"
