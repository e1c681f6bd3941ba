"""The embedding benchmark (bench/embeddings.py): its seeded sentences, and the whole script on the
CPU with the real all-MiniLM-L6-v2 (from its wheel): ours in process and over HTTP, and against
sentence-transformers with the parity check where that library is installed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.embeddings import make_sentences

REPO = Path(__file__).resolve().parents[2]
VOCABULARY = {"[CLS]": 0, "##ing": 1, "the": 2, "quick": 3, "fox": 4, "a": 5, "42": 6, "über": 7}


def test_sentences_are_seeded_whole_words_of_10_to_60():
    sentences = make_sentences(VOCABULARY, 50, seed=1)
    assert sentences == make_sentences(VOCABULARY, 50, seed=1)
    assert sentences != make_sentences(VOCABULARY, 50, seed=2)
    for sentence in sentences:
        assert sentence[0].isupper() and sentence.endswith(".")
        words = sentence[:-1].lower().split()
        assert 10 <= len(words) <= 60
        assert set(words) <= {"the", "quick", "fox"}  # no pieces, specials, numbers, one-letter or non-ASCII words


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    out = subprocess.run(
        [sys.executable, "bench/embeddings.py", "--smoke", *args],
        cwd=REPO,
        env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "embeddings.json").read_text()), out.stdout


@pytest.mark.slow
def test_the_smoke_run_times_ours_in_process_and_over_http(tmp_path):
    result, stdout = _run(tmp_path, "--http", "--no-sentence-transformers")
    figures = result["sentences_per_s"]
    assert set(figures) == {"ours float32", "ours over HTTP float32"}
    for by_batch in figures.values():
        assert set(by_batch) == {"batch 1", "batch 16"} and min(by_batch.values()) > 0
    assert result["parity_max_cosine_distance"] is None
    assert "sentences/s" in stdout


@pytest.mark.slow
def test_the_smoke_run_checks_parity_against_sentence_transformers(tmp_path):
    pytest.importorskip("sentence_transformers")
    result, stdout = _run(tmp_path)
    assert set(result["sentences_per_s"]) == {"ours float32", "sentence-transformers float32"}
    assert result["parity_max_cosine_distance"] <= 1e-5
    assert "ours / sentence-transformers, float32, batch 16" in stdout
