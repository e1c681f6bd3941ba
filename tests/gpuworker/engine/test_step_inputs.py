"""The model runner's step inputs: the vectorised preparation against a per-sequence rebuild, and the
alignment that keeps Triton from compiling new kernel variants as batch sizes change."""

from __future__ import annotations

import pytest
from triton.runtime.jit import JITFunction

from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.engine.sequence import PLACEHOLDER_TOKEN_ID
from gpuworker.kernels.attention import paged_decode, prefill, rotary
from gpuworker.kernels.launch import _no_specialization
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import hf_greedy, random_prompts


def expected_inputs(batch, block_size):
    """What prepare_inputs must produce, rebuilt sequence by sequence from the block manager's lists."""
    ids, positions, slots, sample_indices, query_start_loc, seq_lens, tables = [], [], [], [], [0], [], []
    for entry in batch.seqs:
        seq, start, end = entry.seq, entry.start, entry.start + entry.num_new_tokens
        ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_start_loc.append(query_start_loc[-1] + entry.num_new_tokens)
        if entry.samples:
            sample_indices.append(query_start_loc[-1] - 1)
        seq_lens.append(end)
        tables.append(list(seq.block_table))
    return ids, positions, slots, sample_indices, query_start_loc, seq_lens, tables


def test_prepared_inputs_match_the_sequences_and_every_tensor_is_16_byte_aligned(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    # Async scheduling on the CPU: decode inputs are placeholders filled from the previous step.
    engine = LLMEngine(
        path, num_kv_blocks=96, max_model_len=256, block_size=4, max_num_batched_tokens=40, async_scheduling=True
    )
    runner = engine.runner
    prepare = runner.prepare_inputs
    checked = {"steps": 0, "mixed": 0, "placeholders": 0, "every_row": 0}

    def checking_prepare(batch, previous=None, host=None):
        ids, positions, slots, sample_indices, qsl, seq_lens, tables = expected_inputs(batch, 4)
        inputs = prepare(batch, previous, host=host)
        meta = inputs.meta
        for name, tensor in (
            ("input_ids", inputs.input_ids),
            ("positions", inputs.positions),
            ("slot_mapping", meta.slot_mapping),
            ("sample_indices", inputs.sample_indices),
            ("query_start_loc", meta.query_start_loc),
            ("seq_lens", meta.seq_lens),
            ("block_tables", meta.block_tables),
        ):
            assert tensor.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned"
        filled = [
            previous.token_ids[previous.row_of()[entry.seq.seq_id]].item() if token == PLACEHOLDER_TOKEN_ID else token
            for entry, token in zip((e for e in batch.seqs for _ in range(e.num_new_tokens)), ids)
        ]
        assert inputs.input_ids.tolist() == filled
        assert inputs.positions.tolist() == positions
        assert meta.slot_mapping.tolist() == slots
        assert inputs.sample_indices.tolist() == sample_indices
        assert inputs.samples_every_row == (sample_indices == list(range(len(ids))))
        assert meta.query_start_loc.tolist() == qsl == meta.query_start_loc_cpu
        assert meta.seq_lens.tolist() == seq_lens == meta.seq_lens_cpu
        assert meta.max_seq_len == max(seq_lens)
        for row, table, seq_len in zip(meta.block_tables.tolist(), tables, seq_lens):
            used = -(-seq_len // 4)
            assert row[:used] == table[:used]
        checked["steps"] += 1
        checked["mixed"] += 0 < batch.num_decode_seqs < len(batch.seqs)
        checked["placeholders"] += PLACEHOLDER_TOKEN_ID in ids
        checked["every_row"] += inputs.samples_every_row
        return inputs

    runner.prepare_inputs = checking_prepare
    prompts = random_prompts((3, 37, 5, 22, 9, 30, 14), TINY["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    assert [out.outputs[0].token_ids for out in outputs] == hf_greedy(path, prompts, 9)
    assert checked["steps"] > 5 and checked["mixed"] > 0 and checked["placeholders"] > 0 and checked["every_row"] > 0


@pytest.mark.parametrize(
    "module, kernel",
    [
        (prefill, "_prefill_attention"),
        (paged_decode, "_paged_decode"),
        (rotary, "_rotary"),
    ],
)
def test_step_varying_kernel_arguments_are_not_specialised(module, kernel):
    lazy = getattr(module, kernel)
    assert lazy.do_not_specialize
    # Compiled mode, as on a GPU: every name must be a parameter of the kernel (a typo raises here).
    jitted = JITFunction(lazy.fn, **_no_specialization(lazy.do_not_specialize))
    flagged = {p.name for p in jitted.params if p.do_not_specialize and p.do_not_specialize_on_alignment}
    assert flagged == set(lazy.do_not_specialize)
