"""The engine's sliding latency windows: their percentile maths, and what a real engine feeds them."""

from __future__ import annotations

import pytest

from gpuworker.engine.latency import SlidingWindow


def test_p95_is_the_nearest_rank_of_the_samples_in_the_window():
    window = SlidingWindow(window_s=60.0)
    assert window.percentile(95, now=0.0) is None  # no sample: no figure, not 0
    for i, value in enumerate(reversed(range(1, 101))):  # 100, 99, ... 1: order does not matter
        window.add(value / 1000, now=float(i) / 10)
    assert window.percentile(95, now=10.0) == 0.095
    assert window.percentile(100, now=10.0) == 0.1
    assert window.percentile(50, now=10.0) == 0.05
    window.add(7.0, now=10.0)
    assert window.percentile(100, now=10.0) == 7.0


def test_samples_older_than_the_window_leave_it():
    window = SlidingWindow(window_s=60.0)
    window.add(5.0, now=0.0)  # a slow start
    window.add(0.2, now=30.0)
    assert window.percentile(95, now=59.0) == 5.0
    assert window.percentile(95, now=60.0) == 0.2  # 60 s old: out
    assert window.percentile(95, now=90.0) is None  # idle for a minute: nothing recent to report


def test_only_the_latest_samples_are_kept_past_the_cap():
    window = SlidingWindow(window_s=60.0, max_samples=10)
    for i in range(100):
        window.add(float(i), now=1.0)
    assert window.percentile(5, now=1.0) == 90.0  # the 10 newest: 90..99


@pytest.mark.parametrize(("kwargs", "q"), [({"window_s": 0}, 95), ({"max_samples": 0}, 95), ({}, 0), ({}, 101)])
def test_bad_settings_are_value_errors(kwargs, q):
    with pytest.raises(ValueError):
        SlidingWindow(**kwargs).percentile(q)


def test_a_real_engine_records_each_first_token_and_each_later_step(tiny_checkpoint):
    from gpuworker.engine import LLMEngine, SamplingParams

    engine = LLMEngine(tiny_checkpoint("llama"), max_model_len=256)
    assert engine.latency.figures() == {"ttft_p95_s": None, "itl_p95_s": None}
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    engine.generate(["one", "two", "three"], params)
    ttft, itl = engine.latency.time_to_first_token, engine.latency.inter_token
    # One sample per request's first token, one per later token of each (4 each: 5 tokens).
    assert len(ttft._samples) == 3 and len(itl._samples) == 3 * 4
    figures = engine.latency.figures()
    assert 0 < figures["ttft_p95_s"] < 60 and 0 < figures["itl_p95_s"] < 60

    # n=2: both sequences' tokens of a step are one gap, not two (the second would read 0 s).
    engine.generate(["four"], SamplingParams(max_tokens=3, n=2, ignore_eos=True))
    assert all(value > 0 for _, value in itl._samples)


def test_a_real_engine_reports_the_prompt_tokens_queued_and_those_it_prefilled(tiny_checkpoint):
    """The load a replica reports for shedding: prompt tokens not yet prefilled, and a running count
    of those prefilled (chunks included), so that their rate can be measured."""
    from gpuworker.engine import LLMEngine, SamplingParams

    engine = LLMEngine(tiny_checkpoint("llama"), max_model_len=256, max_num_batched_tokens=64)
    prompts = [[(7 * i + j) % 50 + 3 for j in range(100)] for i in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    figures = engine.serving_figures()
    assert (figures["waiting_tokens"], figures["num_prefilled_tokens"]) == (300, 0)
    engine.step()
    figures = engine.serving_figures()
    assert 0 < figures["num_prefilled_tokens"] <= 64
    assert figures["waiting_tokens"] == 300 - figures["num_prefilled_tokens"]
    while engine.has_unfinished_requests():
        engine.step()
    figures = engine.serving_figures()
    assert (figures["waiting_tokens"], figures["num_prefilled_tokens"]) == (0, 300)
