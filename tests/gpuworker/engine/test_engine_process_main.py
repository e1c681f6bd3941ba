"""The engine process's loop (engine_process_main.py) against the raw pipe: it keeps stepping while the
API process reads nothing, and what it then reads adds up to every token, in fewer messages."""

from __future__ import annotations

import pickle
import pickletools
import time

import pytest

from gpuworker.engine import SamplingParams
from gpuworker.engine.engine_process_client import EngineProcess, _Assembly
from gpuworker.engine.engine_process_main import wire
from gpuworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from gpuworker.engine.prompts import TokenizedPrompt

DEADLINE_S = 120
NUM_REQUESTS, MAX_TOKENS = 16, 200


def test_a_wired_output_holds_no_objects_and_reads_back_the_same():
    """The per-step message names no class (a dataclass per output, metrics and logprob entry made
    pickling 512 outputs several times slower), and the API side rebuilds the engine's output."""
    logprobs = [TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.25)]), TokenLogprob(8, -0.1, [(8, -0.1), (2, -3.0)])]
    output = RequestOutput(
        request_id="r",
        prompt="hi",
        prompt_token_ids=[1, 2],
        finished=True,
        num_cached_tokens=16,
        outputs=[
            CompletionOutput(
                index=0,
                text="ab",
                token_ids=[7, 8],
                finish_reason="length",
                logprobs=logprobs,
                delta_text="ab",
                delta_token_ids=[7, 8],
            )
        ],
        metrics=RequestMetrics(
            arrival_time=1.0,
            first_token_time=2.0,
            finish_time=3.0,
            gpu_time_s=0.25,
            num_preemptions=1,
            first_scheduled_time=1.5,
        ),
    )
    data = pickle.dumps(("outputs", [wire(output)], None), protocol=5)
    assert not [op.name for op, _, _ in pickletools.genops(data) if "GLOBAL" in op.name]
    [wired] = pickle.loads(data)[1]
    assert _Assembly(TokenizedPrompt("hi", [1, 2]), accumulate=True).output(wired) == output


@pytest.fixture
def engine_process(tiny_checkpoint):
    process = EngineProcess.start("cpu")
    try:
        process.load(tiny_checkpoint("llama"), {"num_kv_blocks": 256, "max_model_len": 256})
        yield process
    finally:
        process.stop()


def test_the_engine_keeps_stepping_while_the_api_side_reads_nothing(engine_process):
    """A step's outputs never wait on the pipe: 16 streams with 20 logprobs a token make megabytes,
    far more than the pipe holds, and the engine process finishes them all before this side reads
    a byte. Then every token arrives, the steps' deltas merged into fewer messages."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20)
    for i in range(NUM_REQUESTS):
        engine_process.conn.send(("add", i, f"r{i}", TokenizedPrompt(None, [3 + i] * 4), params))
    # Each request needs MAX_TOKENS steps after its prefill; a blocked engine stops counting.
    deadline = time.monotonic() + DEADLINE_S
    while engine_process.num_steps < MAX_TOKENS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_process.num_steps >= MAX_TOKENS, (
        f"the engine process stopped at step {engine_process.num_steps} while nobody read its outputs"
    )

    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(NUM_REQUESTS)}
    logprobs: dict[str, int] = dict.fromkeys(tokens, 0)
    finished: set[str] = set()
    replies, messages = 0, 0
    while len(finished) < NUM_REQUESTS or replies < NUM_REQUESTS:
        assert engine_process.conn.poll(DEADLINE_S), "the engine process sent nothing more"
        message = engine_process.conn.recv()
        if message[0] == "reply":
            assert message[2], message
            replies += 1
            continue
        assert message[0] == "outputs" and message[2] is None
        messages += 1
        for request_id, done, _, _, completions in message[1]:
            [(index, _, delta_ids, _, _, delta_logprobs)] = completions
            tokens[request_id] += delta_ids
            logprobs[request_id] += len(delta_logprobs)
            if done:
                finished.add(request_id)
    assert all(len(ids) == MAX_TOKENS for ids in tokens.values())
    assert all(n == MAX_TOKENS for n in logprobs.values())
    assert messages < MAX_TOKENS  # merged while waiting
