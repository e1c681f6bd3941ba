"""Perplexity on the evaluation text through the engine: windows, the scoring path against
transformers, the command's JSON report, bad input; SmolLM2-135M against its FP8-at-load twin."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gpuworker.contract.quality import parse_perplexity_report
from gpuworker.engine import LLMEngine, SamplingParams
from gpuworker.quality.__main__ import main
from gpuworker.quality.perplexity import EVAL_TEXT, eval_text, measure_perplexity, text_sha256, windows


def test_windows_cut_the_tokens_and_drop_a_last_token_alone():
    assert windows(list(range(10)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows(list(range(10)), 4, 6) == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="window must be at least 2"):
        windows([1, 2, 3], 1, None)
    with pytest.raises(ValueError, match="max_tokens must be at least 2"):
        windows([1, 2, 3], 2, 1)


def test_the_evaluation_text_ships_with_its_source_and_licence():
    assert len(eval_text().split()) > 2000
    readme = (EVAL_TEXT.parent / "README.md").read_text()
    assert "CC0" in readme and "eval_text.txt" in readme


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint("llama"), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16)


def _hf_perplexity(path: Path, token_ids: list[int], window: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows(token_ids, window, None):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            total -= logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            count += len(ids) - 1
    return math.exp(total / count)


def test_perplexity_equals_transformers_on_the_same_windows(engine, tiny_checkpoint):
    text = eval_text()[:300]
    report = measure_perplexity(engine, window=48, text=text)
    token_ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert report.tokens == len(token_ids) - math.ceil(len(token_ids) / 48)
    assert (report.window, report.text_sha256, report.quantization) == (48, text_sha256(text), "")
    expected = _hf_perplexity(tiny_checkpoint("llama"), token_ids, 48)
    assert report.perplexity == pytest.approx(expected, rel=1e-5)


def test_scoring_leaves_serving_as_it_was(engine):
    # A private KV cache: the pool and its prefix cache are untouched, and generation still matches.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = engine.generate([[5, 6, 7, 8] * 5], params)[0].token_ids
    engine.score_tokens(list(range(40, 100)))
    assert engine.generate([[5, 6, 7, 8] * 5], params)[0].token_ids == before


def test_scoring_refuses_bad_input(engine):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        engine.score_tokens([1])
    with pytest.raises(ValueError, match="exceed max_model_len 64"):
        engine.score_tokens(list(range(65)))
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len 64"):
        measure_perplexity(engine, window=65)
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="requests in flight"):
            engine.score_tokens([1, 2, 3])
    finally:
        engine.abort("busy")


def test_the_command_prints_a_report_the_control_plane_reads(tiny_checkpoint, capsys):
    assert main([str(tiny_checkpoint("llama")), "--device", "cpu", "--window", "32", "--max-tokens", "64"]) == 0
    report = parse_perplexity_report(json.loads(capsys.readouterr().out))
    assert (report.tokens, report.window, report.text_sha256) == (62, 32, text_sha256(eval_text()))
    assert report.perplexity > 1


def test_the_command_names_bad_input(tiny_checkpoint, capsys):
    assert main([str(tiny_checkpoint("llama")), "--device", "cpu", "--window", "1"]) == 2
    assert "window must be at least 2" in capsys.readouterr().err
