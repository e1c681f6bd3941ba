"""The embedding engine: requests queue up, a background thread takes what is waiting and runs it
through the encoder packed (the inputs back to back, no padding; models/bert.py), in passes of at
most max_batch_tokens tokens, and hands each request its vectors.

    engine = EmbeddingEngine("/models/all-MiniLM-L6-v2", device="cuda")
    vectors = await engine.embed(engine.tokenize(["a sentence", "another"]))

Inputs are checked once: tokenize and check return CheckedIds, which embed takes as they are
(the replica checks off the event loop, so a bad request is refused before it queues).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from gpuworker.models.bert import BertEncoder, PackedBatch, is_sentence_encoder, load_bert_encoder  # noqa: F401 (re-exported for the replica)

logger = logging.getLogger(__name__)

# Tokens in one forward pass: bounds the activations' memory.
DEFAULT_MAX_BATCH_TOKENS = 65_536


class CheckedIds(list):
    """Token ids (a list per input) that EmbeddingEngine.check accepted."""


@dataclass
class _Job:
    token_ids: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    vectors: list[torch.Tensor | None] = field(default_factory=list)


def passes(lengths: list[int], max_batch_tokens: int) -> list[range]:
    """Consecutive inputs grouped into forward passes of at most max_batch_tokens tokens (an input
    longer than that alone)."""
    groups: list[range] = []
    start, tokens = 0, 0
    for i, length in enumerate(lengths):
        if i > start and tokens + length > max_batch_tokens:
            groups.append(range(start, i))
            start, tokens = i, 0
        tokens += length
    if start < len(lengths):
        groups.append(range(start, len(lengths)))
    return groups


class EmbeddingEngine:
    def __init__(
        self,
        model: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    ) -> None:
        self.model: BertEncoder = load_bert_encoder(model, device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self._encoder = _batch_encoder(self.tokenizer)
        self.device, self.max_batch_tokens = device, max_batch_tokens
        self.num_embedded_inputs = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="embedding-engine", daemon=True)
        self._thread.start()

    @property
    def dimensions(self) -> int:
        return self.model.dimensions

    @property
    def max_tokens(self) -> int:
        return self.model.max_tokens

    def tokenize(self, texts: list[str]) -> CheckedIds:
        """Token ids with the model's special tokens; ValueError naming the first input that is too long."""
        if self._encoder is not None:
            ids = [encoding.ids for encoding in self._encoder.encode_batch_fast(texts, add_special_tokens=True)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        return self.check(ids)

    def check(self, token_ids: list[list[int]]) -> CheckedIds:
        """token_ids as CheckedIds; ValueError naming the first input that is empty, too long or
        holds an id outside the vocabulary."""
        if isinstance(token_ids, CheckedIds):
            return token_ids
        vocab = self.model.config.vocab_size
        for index, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"input {index} is empty")
            if len(ids) > self.max_tokens:
                raise ValueError(f"input {index} has {len(ids)} tokens; this model takes at most {self.max_tokens}")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {index} holds a token id outside [0, {vocab})")
        return CheckedIds(token_ids)

    async def embed(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """One float32 vector (on the CPU) per input, in order; ValueError as check for ids it has
        not checked."""
        token_ids = self.check(token_ids)
        loop = asyncio.get_running_loop()
        job = _Job(token_ids, loop, loop.create_future())
        self._queue.put(job)
        return await job.future

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while True:  # everything waiting now goes into the same passes
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            try:
                self._run(jobs)
            except Exception as exc:  # a failed batch fails its requests, not the engine
                logger.exception("an embedding batch failed")
                for j in jobs:
                    j.loop.call_soon_threadsafe(_resolve, j.future, None, exc)
                continue
            for j in jobs:
                j.loop.call_soon_threadsafe(_resolve, j.future, j.vectors, None)

    def _run(self, jobs: list[_Job]) -> None:
        token_ids = [ids for j in jobs for ids in j.token_ids]
        # One copy back to the host at the end: the passes queue up on the device without a
        # synchronisation between them.
        vectors = torch.cat(
            [
                self.model(PackedBatch.build(token_ids[group.start : group.stop], self.device))
                for group in passes([len(ids) for ids in token_ids], self.max_batch_tokens)
            ]
        ).cpu()
        row = 0
        for j in jobs:
            j.vectors = list(vectors[row : row + len(j.token_ids)])
            row += len(j.token_ids)
        self.num_embedded_inputs += len(token_ids)


def _batch_encoder(tokenizer) -> Tokenizer | None:
    """The fast tokenizer's Rust pipeline as transformers set it up (its normaliser follows
    tokenizer_config.json), without the padding or truncation a tokenizer.json may carry. Its
    encode_batch_fast gives the same ids as calling the tokenizer, without building the offsets,
    attention masks and token types a sentence encoder does not read: at batch 256 that is most of
    the host's time per request. None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    encoder = Tokenizer.from_str(backend.to_str())
    encoder.no_padding()
    encoder.no_truncation()
    return encoder


def _resolve(future: asyncio.Future, result, error) -> None:
    if future.done():  # the caller left
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
