"""Kernel launches over a run whose batch shapes change every step keep one Triton specialisation.

Triton compiles a variant of a kernel per pattern of "pointer 16-byte aligned", "integer == 1" and
"integer divisible by 16" among its non-constexpr arguments (those not marked do_not_specialize).
On the GPU each new pattern costs about a second of compilation in the middle of serving; on an
H200 an offline run spent 9 s of 59 compiling them. This drives the engine with the Triton backend
(under the interpreter on a CPU, compiled on a GPU, where decode-only steps replay CUDA graphs)
through prefills, chunked prefills, mixed and decode steps of varying sizes and checks that every
kernel saw a single pattern.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
import triton.language as tl

from gpuworker.attention.triton_backend import TritonAttentionBackend
from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.kernels.launch import LazyJIT
from tests.gpuworker.checkpoints import TINY, make_checkpoint
from tests.gpuworker.engine.reference import random_prompts


def _pattern(lazy: LazyJIT, args: tuple, kwargs: dict, with_constexprs: bool = False) -> tuple:
    """What Triton keys a compiled variant on: the specialisation of the arguments and, with
    with_constexprs, the constexpr values and launch options too."""
    signature = inspect.signature(lazy.fn)
    # Launch options (num_warps, num_stages) are not kernel parameters.
    options = {k: v for k, v in kwargs.items() if k not in signature.parameters}
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    pattern = [tuple(sorted(options.items()))] if with_constexprs else []
    for name, value in bound.arguments.items():
        if signature.parameters[name].annotation in (tl.constexpr, "tl.constexpr"):
            if with_constexprs:
                pattern.append((name, value))
            continue
        if name in lazy.do_not_specialize:
            continue
        if isinstance(value, torch.Tensor):
            pattern.append((name, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            pattern.append((name, value == 1, value % 16 == 0))
    return tuple(pattern)


def _record_patterns(monkeypatch, *, with_constexprs: bool = False) -> dict[str, set[tuple]]:
    """From now on, every kernel launch adds its _pattern to the returned {kernel name: patterns}."""
    patterns: dict[str, set[tuple]] = defaultdict(set)
    getitem = LazyJIT.__getitem__

    def recording(self, grid):
        launch = getitem(self, grid)

        def run(*args, **kwargs):
            patterns[self.fn.__name__].add(_pattern(self, args, kwargs, with_constexprs=with_constexprs))
            return launch(*args, **kwargs)

        return run

    monkeypatch.setattr(LazyJIT, "__getitem__", recording)
    return patterns


def test_one_specialisation_per_kernel_across_changing_batches(tmp_path, monkeypatch, device):
    patterns = _record_patterns(monkeypatch)
    path = make_checkpoint(tmp_path, "llama")
    engine = LLMEngine(
        path,
        device=device,
        attn_backend=TritonAttentionBackend(),
        num_kv_blocks=128,
        max_model_len=256,
        block_size=4,
        max_num_batched_tokens=29,
    )
    # Odd lengths and a small token budget: chunked prefills, mixed steps and decode batches of many
    # sizes, block tables of many widths.
    prompts = random_prompts((3, 27, 5, 40, 9, 18, 33, 2, 11), TINY["vocab_size"])
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17, 5, 12, 7, 20, 4, 15)]
    engine.generate(prompts, params)
    assert {"_prefill_attention_kernel", "_paged_decode_kernel", "_rotary_kernel"} <= set(patterns)
    varied = {name: sorted(seen) for name, seen in patterns.items() if len(seen) > 1}
    assert not varied, f"kernels compiled in several variants: {varied}"


def test_warm_up_compiles_what_later_steps_use_and_leaves_outputs_alone(tmp_path, monkeypatch, device):
    """ModelRunner.warm_up (run at start on CUDA) launches every eager-path kernel in the pattern the
    engine's steps then use, so none compiles during requests; the engine's outputs do not change."""
    from tests.gpuworker.engine.reference import hf_greedy

    patterns = _record_patterns(monkeypatch, with_constexprs=True)
    path = make_checkpoint(tmp_path, "llama")
    # A context long enough for the decode kernel to split it, as on a GPU.
    engine = LLMEngine(
        path,
        device=device,
        attn_backend=TritonAttentionBackend(),
        num_kv_blocks=160,
        max_model_len=256,
        block_size=4,
        max_num_batched_tokens=29,
    )
    engine.runner.warm_up()
    warmed = {name: set(seen) for name, seen in patterns.items()}
    assert {"_prefill_attention_kernel", "_paged_decode_kernel", "_rotary_kernel"} <= set(warmed)
    # Chunked prefills, mixed and decode steps of many sizes; contexts past one 64-token partition
    # (the decode kernel splits them in several ways).
    prompts = random_prompts((7, 90, 3, 27, 5, 40, 9, 18, 70, 2, 11), TINY["vocab_size"])
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [out.outputs[0].token_ids for out in outputs] == hf_greedy(path, prompts, 8)
    new = {name: seen - warmed.get(name, set()) for name, seen in patterns.items()}
    assert not any(new.values()), f"compiled after the warm-up: {new}"
