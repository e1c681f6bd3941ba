"""The embedding engine: requests queue up, a background thread takes what is waiting and runs it
through the encoder in padding-aware buckets (inputs sorted by length, each batch padded only to
its own longest), and hands each request its vectors.

    engine = EmbeddingEngine("/models/all-MiniLM-L6-v2", device="cuda")
    vectors, prompt_tokens = await engine.embed(["a sentence", "another"])
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from gpuworker.models.bert import BertEncoder, is_sentence_encoder, load_bert_encoder  # noqa: F401 (re-exported for the replica)

logger = logging.getLogger(__name__)

# Tokens in one forward pass (batch x padded length): bounds the activations' memory.
DEFAULT_MAX_BATCH_TOKENS = 65_536
# A batch is padded to a multiple of this many tokens: fewer distinct shapes for the kernels.
PAD_MULTIPLE = 8
# Sorted inputs go to one bucket while the longest stays within this factor of the shortest, so
# short sentences are not padded to a long one's length.
BUCKET_GROWTH = 2.0


@dataclass
class _Job:
    token_ids: list[list[int]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    vectors: list[torch.Tensor | None] = field(default_factory=list)


def buckets(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into batches: by length, each within BUCKET_GROWTH of its
    shortest and with batch size x longest <= max_batch_tokens (a single longer input alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group and lengths[i] <= BUCKET_GROWTH * max(lengths[group[0]], 1) \
                and (len(group) + 1) * lengths[i] <= max_batch_tokens:
            group.append(i)
        else:
            groups.append([i])
    return groups


class EmbeddingEngine:
    def __init__(self, model: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
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

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the model's special tokens; ValueError naming the first input that is too long."""
        if self._encoder is not None:
            ids = [encoding.ids for encoding in self._encoder.encode_batch_fast(texts, add_special_tokens=True)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        self.check(ids)
        return ids

    def check(self, token_ids: list[list[int]]) -> None:
        vocab = self.model.config.vocab_size
        for index, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"input {index} is empty")
            if len(ids) > self.max_tokens:
                raise ValueError(f"input {index} has {len(ids)} tokens; this model takes at most {self.max_tokens}")
            if min(ids) < 0 or max(ids) >= vocab:
                raise ValueError(f"input {index} holds a token id outside [0, {vocab})")

    async def embed(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """One float32 vector (on the CPU) per input, in order."""
        self.check(token_ids)
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
            while True:  # everything waiting now goes into the same buckets
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
        owners = [(j, k) for j in jobs for k in range(len(j.token_ids))]
        token_ids = [ids for j in jobs for ids in j.token_ids]
        groups = buckets([len(ids) for ids in token_ids], self.max_batch_tokens)
        # One copy back to the host at the end: the buckets' forward passes queue up on the device
        # without a synchronisation between them.
        vectors = torch.cat([self.model(*self._padded([token_ids[i] for i in group])) for group in groups]).cpu()
        for j in jobs:
            j.vectors = [None] * len(j.token_ids)
        for row, i in enumerate(i for group in groups for i in group):
            job, k = owners[i]
            job.vectors[k] = vectors[row]
        self.num_embedded_inputs += len(token_ids)

    def _padded(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and their mask on the device, built with one tensor per batch (not per row)."""
        lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
        longest = int(lengths.max())
        width = min(-(-longest // PAD_MULTIPLE) * PAD_MULTIPLE, max(longest, self.model.config.max_position_embeddings))
        mask = np.arange(width) < lengths[:, None]
        input_ids = np.zeros(mask.shape, dtype=np.int64)
        # Row-major: each row's ids, in one pass over them (numpy: a tenth of the time of torch here).
        input_ids[mask] = np.fromiter(itertools.chain.from_iterable(batch), dtype=np.int64, count=int(lengths.sum()))
        return (torch.from_numpy(input_ids).to(self.device, non_blocking=True),
                torch.from_numpy(mask).to(self.device, non_blocking=True))


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
