"""LLMEngine end to end on a tiny llama: input errors, n choices, seeds, filters, logprobs, stop
strings, chat, aborts and the per-request accounting, checked against transformers where it applies."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine import EngineConfig, LLMEngine, SamplingParams
from tests.gpuworker.checkpoints import TINY
from tests.gpuworker.engine.reference import hf_greedy, hf_logits, random_prompts


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama")


def make_engine(path, **overrides) -> LLMEngine:
    kwargs = dict(num_kv_blocks=64, max_model_len=256)
    kwargs.update(overrides)
    return LLMEngine(path, **kwargs)


def run(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return finished


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ([], SamplingParams(), "prompt must be a non-empty"),
        ([1, 2, 999], SamplingParams(), r"prompt: token id 999 is not in \[0, 384\)"),
        ([1] * 250, SamplingParams(max_tokens=10), r"max_tokens \(10\) = 260 exceeds max_model_len \(256\)"),
        ([1] * 256, SamplingParams(), r"prompt has 256 tokens, which leaves no room"),
        ([1, 2], SamplingParams(logit_bias={5: 1.0, 384: -100}), r"logit_bias: token id 384 is not in \[0, 384\)"),
    ],
)
def test_bad_requests_fail_alone_and_the_others_keep_running(path, prompt, params, match):
    engine = make_engine(path)
    prompts = random_prompts((5, 30), TINY["vocab_size"])
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("good-0", prompts[0], greedy)
    engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, params)
    engine.add_request("good-1", prompts[1], greedy)
    finished = run(engine)
    assert sorted(finished) == ["good-0", "good-1"]
    assert [finished[f"good-{i}"].token_ids for i in range(2)] == hf_greedy(path, prompts, 6)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"load_format": "pt"}, "load_format"),
        ({"num_kv_blocks": 4, "max_model_len": 100}, "num_kv_blocks"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"short_prefill_share": 1.0}, "short_prefill_share"),
        ({"batch_prefill_share": 0}, "batch_prefill_share"),
        ({"batch_prefill_share": 1.5}, "batch_prefill_share"),
        ({"batch_prefill_share": True}, "batch_prefill_share"),
        ({"batch_prefill_share": "0.25"}, "batch_prefill_share"),
    ],
)
def test_engine_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="/models/x", **kwargs)


def test_max_model_len_beyond_the_model_is_rejected(path):
    with pytest.raises(
        ValueError, match=r"max_model_len \(2048\) exceeds the model.s context \(1024.*allow_long_context"
    ):
        make_engine(path, max_model_len=2048, num_kv_blocks=200)


def test_pool_sized_from_the_memory_budget(path):
    engine = LLMEngine(path, kv_cache_memory_bytes=40 * 8192, max_num_seqs=4)
    # 2 layers x 2 x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block.
    assert engine.config.num_kv_blocks == 40
    # The pool cannot hold the model's 1024 positions, so max_model_len follows the pool.
    assert engine.config.max_model_len == 640
    assert engine.runner.kv_cache.shape == (2, 2, 40, 16, 2, 16)


def test_generate_takes_text_or_ids_and_keeps_input_order(path):
    engine = make_engine(path)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    text_out, ids_out = engine.generate(["Hello there", list("Hello there".encode())], greedy)
    assert text_out.prompt_token_ids[0] == engine.tokenizer.bos_token_id
    assert text_out.prompt_token_ids[1:] == ids_out.prompt_token_ids
    single = engine.generate("Hi", greedy)
    assert len(single) == 1 and single[0].prompt == "Hi"


def test_chat_applies_the_template(path):
    engine = make_engine(path)
    messages = [{"role": "user", "content": "Hi!"}]
    (out,) = engine.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out.prompt_token_ids == expected["input_ids"]
    assert out.prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert out.token_ids == hf_greedy(path, [expected["input_ids"]], 4)[0]


def test_n_choices_share_the_prompt_blocks(path):
    engine = make_engine(path)
    prompt = random_prompts((40,), TINY["vocab_size"])[0]
    engine.add_request("n", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    engine.step()
    parent, *children = engine.scheduler.running
    assert [seq.index for seq in children] == [1, 2]
    assert all(child.block_table == parent.block_table[:2] for child in children)
    tokens = engine.last_step_stats.tokens_per_request["n"]
    engine.step()
    tokens += engine.last_step_stats.tokens_per_request["n"]
    # 40 prompt tokens once, then only the 8-token tail for each child, plus the parent's decode.
    assert tokens == 40 + 1 + 2 * 8
    (out,) = run(engine).values()
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert engine.scheduler.block_manager.usage == 0.0


def test_greedy_n_choices_all_equal_transformers(path):
    prompt = random_prompts((20,), TINY["vocab_size"])[0]
    (out,) = make_engine(path).generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))
    reference = hf_greedy(path, [prompt], 6)[0]
    assert [c.token_ids for c in out.outputs] == [reference, reference]


def test_seeded_requests_repeat_whatever_else_is_batched(path):
    prompts = random_prompts((12, 50, 3, 90), TINY["vocab_size"], seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = make_engine(path).generate([prompts[0]], seeded)[0].token_ids
    others = [
        SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.2, seed=1, max_tokens=9, ignore_eos=True),
    ]
    engine = make_engine(path, max_num_batched_tokens=32, seed=123)
    batched = engine.generate(prompts[1:2] + prompts[:1] + prompts[2:], [others[0], seeded, *others[1:]])
    assert batched[1].token_ids == alone
    # And through preemption and recomputation, in a pool that holds one sequence.
    tight = make_engine(path, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32)
    again = tight.generate(prompts[1:2] + prompts[:1] + prompts[2:], [others[0], seeded, *others[1:]])
    assert tight.scheduler.num_preemptions > 0
    assert again[1].token_ids == alone


def test_top_k_tokens_are_among_the_k_most_likely(path):
    prompt = random_prompts((10,), TINY["vocab_size"], seed=9)[0]
    params = [SamplingParams(temperature=1.5, top_k=3, seed=s, max_tokens=6, ignore_eos=True) for s in range(4)]
    outputs = make_engine(path).generate([prompt] * 4, params)
    for out in outputs:
        logits = hf_logits(path, prompt + out.token_ids)
        for t, token in enumerate(out.token_ids):
            assert token in logits[len(prompt) + t - 1].topk(3).indices.tolist()
    assert len({tuple(out.token_ids) for out in outputs}) > 1


def test_logprobs_match_transformers(path):
    prompt = random_prompts((25,), TINY["vocab_size"], seed=2)[0]
    (out,) = make_engine(path).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    )
    reference = torch.log_softmax(hf_logits(path, prompt + out.token_ids), dim=-1)
    logprobs = out.outputs[0].logprobs
    assert len(logprobs) == 5
    for t, entry in enumerate(logprobs):
        row = reference[len(prompt) + t - 1]
        assert entry.token_id == out.token_ids[t]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert [i for i, _ in entry.top_logprobs] == row.topk(3).indices.tolist()
        assert [v for _, v in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)


def test_logit_bias_equals_transformers_sequence_bias(path):
    """Greedy with a bias on a few tokens takes the path transformers takes with the same biases
    (its SequenceBiasLogitsProcessor adds them to the logits of single-token sequences): small
    biases that change some choices, +100 that forces a token, -100 that bans one."""
    from transformers import GenerationConfig

    from tests.gpuworker.engine.reference import hf_model

    prompts = random_prompts((7, 30), TINY["vocab_size"], seed=11)
    engine = make_engine(path)
    changed = 0
    for prompt, unbiased in zip(prompts, hf_greedy(path, prompts, 8)):
        ban, nudge, force = {unbiased[0]: -100.0}, {unbiased[2]: -3.0, unbiased[4]: -2.5, 17: 2.0}, {42: 100.0}
        outputs = engine.generate(
            [prompt] * 3,
            [
                SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias=bias)
                for bias in (ban, nudge, force)
            ],
        )
        for bias, out in zip((ban, nudge, force), outputs):
            config = GenerationConfig(
                do_sample=False,
                max_new_tokens=8,
                eos_token_id=-1,
                sequence_bias={(token,): value for token, value in bias.items()},
            )
            ids = torch.tensor([prompt])
            with torch.no_grad():
                reference = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            assert out.token_ids == reference[0, len(prompt) :].tolist(), bias
        assert outputs[0].token_ids[0] != unbiased[0] and outputs[2].token_ids == [42] * 8
        changed += outputs[1].token_ids != unbiased
    assert changed  # the small biases changed a greedy path, and it still matched


def test_stop_string_split_across_tokens_through_the_engine(path):
    engine = make_engine(path)
    prompt = random_prompts((8,), TINY["vocab_size"], seed=11)[0]
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    free = engine.generate([prompt], SamplingParams(**greedy))[0]
    # Two whole characters from the middle of the (noise) text: at least two byte tokens.
    text = free.text
    start = next(
        i for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2] and text.index(text[i : i + 2]) == i
    )
    stop = text[start : start + 2]
    out = engine.generate([prompt], SamplingParams(stop=[stop], **greedy))[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]


def test_eos_ends_the_request_unless_ignored(path):
    engine = make_engine(path)
    prompt = random_prompts((6,), TINY["vocab_size"], seed=3)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    engine.eos_token_ids = [free.token_ids[3]]  # pretend the 4th token is the model's EOS
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:4]


def test_abort_frees_blocks_and_reports_abort(path):
    engine = make_engine(path)
    engine.add_request("a", [1] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [2] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.scheduler.block_manager.usage > 0
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert engine.abort("a") is None
    engine.abort("b")
    assert engine.scheduler.block_manager.usage == 0.0 and not engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_time_is_shared_out_by_tokens(path, async_scheduling):
    engine = make_engine(path, async_scheduling=async_scheduling)
    prompts = random_prompts((100, 4), TINY["vocab_size"])
    total = 0.0
    engine.add_request("long", prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("short", prompts[1], SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        # With async scheduling the first call only launches: no step has completed yet.
        total += engine.last_step_stats.duration_s if engine.last_step_stats else 0.0
        finished.update({out.request_id: out for out in outputs if out.finished})
    long, short = finished["long"].metrics.gpu_time_s, finished["short"].metrics.gpu_time_s
    assert long + short == pytest.approx(total)
    assert long > short > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_time_of_concurrent_requests_adds_up_to_the_busy_time(path, async_scheduling):
    """Requests of different lengths, some joining while others run: the GPU seconds they report
    add up to the engine's own busy time (the wall time of its steps), so a margin computed from
    them is computed from the time the GPU was really busy."""
    engine = make_engine(path, async_scheduling=async_scheduling, max_num_batched_tokens=64)
    lengths = (120, 7, 60, 33, 90, 15, 48, 3)
    prompts = random_prompts(lengths, TINY["vocab_size"], seed=11)
    waiting = [
        (f"r{i}", prompt, SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True)) for i, prompt in enumerate(prompts)
    ]
    finished = {}
    while waiting or engine.has_unfinished_requests():
        if waiting:  # one more request joins at each step, while the earlier ones run
            engine.add_request(*waiting.pop(0))
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    assert sorted(finished) == sorted(f"r{i}" for i in range(len(lengths)))
    shares = [out.metrics.gpu_time_s for out in finished.values()]
    assert all(share > 0 for share in shares)
    assert sum(shares) == pytest.approx(engine.busy_time_s, rel=0.05)


def test_prefill_time_counts_only_the_steps_that_prefilled(path):
    """The load report's prefill rate is prompt tokens over the time of the steps that computed
    them: decode-only steps (and idle time) add nothing to it, so a replica that prefilled fast
    and then decoded for long still reports how fast it drains a prompt queue."""
    engine = make_engine(path, max_num_batched_tokens=64)
    engine.add_request("r", random_prompts((100,), TINY["vocab_size"], seed=3)[0], SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    prefilled, after_prefill = engine.num_prefilled_tokens, engine.prefill_time_s
    assert prefilled == 100 and 0 < after_prefill <= engine.busy_time_s
    engine.add_request("d", [1], SamplingParams(max_tokens=24, ignore_eos=True))
    engine.step()  # its one-token prefill
    one_token = engine.prefill_time_s
    while engine.has_unfinished_requests():
        engine.step()  # decode steps only
    assert engine.prefill_time_s == one_token and engine.busy_time_s > one_token
    assert engine.serving_figures()["prefill_time_s"] == engine.prefill_time_s


def test_a_short_request_is_not_starved_by_long_prefills(path):
    """A short prompt that arrives while long ones prefill gets its first token at the next step,
    however many long prompts came first; in plain arrival order (short_prefill_share=0) it waited
    for all of their prefills. Either way every request gets the same tokens."""
    long_prompts = random_prompts((900, 900, 900, 900), TINY["vocab_size"], seed=5)
    short_prompt = random_prompts((16,), TINY["vocab_size"], seed=6)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    def run_with(short_prefill_share: float) -> tuple[int, dict[str, list[int]]]:
        # 256 tokens a step: each long prompt takes 4 steps to prefill. Short prompts: <= 32 tokens.
        engine = make_engine(
            path,
            num_kv_blocks=256,
            max_model_len=1024,
            max_num_batched_tokens=256,
            short_prefill_share=short_prefill_share,
        )
        for i, prompt in enumerate(long_prompts):
            engine.add_request(f"long{i}", prompt, params)
        engine.step()
        engine.add_request("short", short_prompt, params)
        steps, first_token_step, tokens = 0, None, {}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            for out in outputs:
                if out.request_id == "short" and first_token_step is None:
                    first_token_step = steps
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
        return first_token_step, tokens

    steps, tokens = run_with(0.125)
    fifo_steps, fifo_tokens = run_with(0.0)
    assert steps == 1
    assert fifo_steps >= 13  # the 3,600 - 256 prompt tokens ahead of it, 256 a step
    assert tokens == fifo_tokens


def test_dummy_weights_without_a_tokenizer_take_token_ids(tiny_checkpoint):
    path = tiny_checkpoint("qwen3", tokenizer=False)
    engine = LLMEngine(path, load_format="dummy", num_kv_blocks=32, max_model_len=128)
    assert engine.tokenizer is None
    (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("text", "hello", SamplingParams())


def test_async_scheduling_abort_with_a_token_in_flight(path):
    prompts = random_prompts((30, 50), TINY["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = make_engine(path).generate(prompts, params)
    engine = make_engine(path, async_scheduling=True)
    engine.add_request("keep", prompts[0], params)
    engine.add_request("drop", prompts[1], params)
    for _ in range(4):
        engine.step()
    # "drop" now has a sampled token still in flight (a placeholder in its token ids).
    dropped = engine.abort("drop")
    assert dropped.finished and dropped.outputs[0].finish_reason == "abort"
    assert all(token >= 0 for token in dropped.outputs[0].token_ids)
    assert dropped.outputs[0].token_ids == reference[1].outputs[0].token_ids[: len(dropped.outputs[0].token_ids)]
    finished = run(engine)
    assert finished["keep"].outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert engine.scheduler.block_manager.usage == 0.0 and not engine.scheduler.running


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_final_only_requests_report_once_with_the_same_result(path, async_scheduling):
    """An offline request asks for its output only when it finishes; it gets the same tokens and
    text as a cumulative request, and step() returns nothing for it before then."""
    engine = make_engine(path, async_scheduling=async_scheduling)
    prompt = random_prompts((9,), 384, seed=3)[0]
    engine.add_request("cumulative", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request(
        "final", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="final_only")
    )
    seen: dict[str, list] = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["cumulative"]) == 6 and len(seen["final"]) == 1
    final, last = seen["final"][0], seen["cumulative"][-1]
    assert final.finished and final.token_ids == last.token_ids and final.text == last.text
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="delta-ish")


def test_a_text_far_beyond_the_context_is_refused_from_its_head(path, monkeypatch):
    """Tokenizing megabytes only to refuse them would keep a core busy for seconds: only the head
    (max_model_len x PREFIX_CHARS_PER_TOKEN characters) is tokenized, and the text is refused."""
    from gpuworker.engine.prompts import PREFIX_CHARS_PER_TOKEN

    engine = make_engine(path)
    tokenized: list[int] = []

    class RecordingTokenizer:
        def __init__(self, real):
            self.real = real

        def encode_batch(self, texts, *args, **kwargs):
            tokenized.extend(len(text) for text in texts)
            return self.real.encode_batch(texts, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(engine.tokenizer, "_tokenizer", RecordingTokenizer(engine.tokenizer._tokenizer))
    huge = "hello world " * 100_000
    with pytest.raises(ValueError, match=r"prompt has at least \d+ tokens .* max_model_len \(256\)"):
        engine.tokenize(huge)
    assert tokenized == [256 * PREFIX_CHARS_PER_TOKEN]
    # A text within the head's reach is tokenized whole, as before.
    tokenized.clear()
    assert engine.tokenize("hello world").token_ids and tokenized == [len("hello world")]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_delta_requests_report_only_what_each_step_added(path, async_scheduling):
    """output_kind="delta" (what the engine process asks for): each output's text, token ids and
    logprobs are the step's alone, and joined they are the cumulative request's final output."""
    engine = make_engine(path, async_scheduling=async_scheduling)
    prompt = random_prompts((9,), 384, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine.add_request("cumulative", prompt, params)
    engine.add_request("delta", prompt, SamplingParams(**{**params.__dict__, "output_kind": "delta"}))
    seen: dict[str, list] = {"cumulative": [], "delta": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    deltas, last = [out.outputs[0] for out in seen["delta"]], seen["cumulative"][-1].outputs[0]
    assert len(deltas) == 6 and seen["delta"][-1].finished
    assert all(c.token_ids == c.delta_token_ids and len(c.token_ids) == 1 and len(c.logprobs) == 1 for c in deltas)
    assert [t for c in deltas for t in c.token_ids] == last.token_ids
    assert "".join(c.text for c in deltas) == last.text
    assert [e for c in deltas for e in c.logprobs] == last.logprobs
