"""Images in requests: their preprocessed inputs, where their tokens sit in a prompt, their rotary
positions, their part in prefix-cache keys, and the cache of their encoder output.

The serving side calls `preprocess_image` (a pure function: run it in a worker process) and hands
the engine ImageInputs with prompt token ids whose image placeholder is already expanded to each
image's token count (`expand_image_tokens`). The engine encodes images inside its step, for the
prefill chunks that need them, and keeps the embeddings by content hash (ImageEmbeddingCache).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image: the processor's patches, its grid and how many prompt tokens it fills."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch] float32, on the host
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches
    num_tokens: int  # prompt tokens the image fills: t * h * w / merge_size ** 2
    content_hash: str  # sha256 of the pixel values and grid: equal images share KV and embeddings


@functools.lru_cache(maxsize=8)
def _image_processor(model_dir: str) -> Any:
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(model_dir)


def preprocess_image(model_dir: str | Path, image: Any) -> ImageInput:
    """A PIL image -> the ImageInput of the checkpoint in model_dir (its preprocessor_config.json,
    through transformers' own image processor: Qwen2VLImageProcessor's dynamic resolution between
    min_pixels and max_pixels). Pure and CPU-only: safe to run in a pool of worker processes."""
    processor = _image_processor(str(model_dir))
    out = processor(images=[image.convert("RGB")], return_tensors="pt")
    pixel_values = out["pixel_values"].to(torch.float32).contiguous()
    if "image_grid_thw" in out:  # dynamic resolution (Qwen2-VL's processor): patches of a grid
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        num_tokens = grid[0] * grid[1] * grid[2] // int(getattr(processor, "merge_size", 2)) ** 2
    else:  # one fixed-size image (Gemma 3's SigLIP): mm_tokens_per_image tokens
        if pixel_values.shape[0] != 1:
            raise ValueError(f"{model_dir}: the image processor made {pixel_values.shape[0]} crops; expected 1")
        grid = (1, int(pixel_values.shape[-2]), int(pixel_values.shape[-1]))
        num_tokens = _tokens_per_image(str(model_dir))
    digest = hashlib.sha256(pixel_values.numpy().tobytes())
    digest.update(repr(grid).encode())
    return ImageInput(pixel_values, grid, num_tokens, digest.hexdigest())


def preprocess_request_image(model_dir: str, image: Any, detail: str) -> ImageInput:
    """`preprocess_image` as the replica's image pool calls it (image, detail): bind model_dir with
    functools.partial for a picklable callable. The pool has already scaled a "low" detail image
    down (`replica.images.decoding.at_detail`); the processor then picks the resolution of what it
    is given, so the image's tokens and content hash (its prefix-cache and embedding key) follow
    the resolution used."""
    return preprocess_image(model_dir, image)


@functools.lru_cache(maxsize=8)
def _tokens_per_image(model_dir: str) -> int:
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("mm_tokens_per_image", 256))


def expand_image_tokens(token_ids: list[int], images: list[ImageInput], image_token_id: int) -> list[int]:
    """Each image_token_id of token_ids (one per image, in order) repeated as many times as its image
    has tokens."""
    out: list[int] = []
    it = iter(images)
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        image = next(it, None)
        if image is None:
            raise ValueError(f"the prompt has more image tokens than the {len(images)} image(s) given")
        out += [image_token_id] * image.num_tokens
    if next(it, None) is not None:
        raise ValueError(f"the prompt has fewer image tokens than the {len(images)} image(s) given")
    return out


@dataclass
class MultimodalPrompt:
    """A request's images, where each one's tokens start in its prompt, and their rotary positions."""

    images: list[ImageInput]
    starts: list[int]
    rotary_positions: np.ndarray | None = None  # [3, prompt tokens] (time, height, width), or None
    rotary_delta: int = 0  # generated token at position p rotates at p + rotary_delta
    # A prefill chunk may not end inside an image (its tokens attend to each other both ways).
    whole_images: bool = False
    _keys: dict[int, tuple] = field(default_factory=dict, repr=False)

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk [start, end) may end: before an image it would cut (with
        whole_images), or `end`. Equal to start when the chunk cannot take the image it is in."""
        if not self.whole_images:
            return end
        for image, first in zip(self.images, self.starts):
            if first < end < first + image.num_tokens:
                return max(start, first)
        return end

    def block_keys(self, start: int, size: int) -> tuple:
        """What the prefix cache keys a block of tokens [start, start + size) by besides its token
        ids: the hash of each image with tokens in it and the offset of the block in that image."""
        keys = self._keys.get(start)
        if keys is None:
            keys = tuple(
                ("image", image.content_hash, max(0, start - first))
                for image, first in zip(self.images, self.starts)
                if first < start + size and start < first + image.num_tokens
            )
            self._keys[start] = keys
        return keys


def locate_images(token_ids: list[int], images: list[ImageInput], image_token_id: int, model: str) -> list[int]:
    """The first token of each image's run of image tokens; ValueError where runs and images differ."""
    ids = np.asarray(token_ids, dtype=np.int64)
    is_image = np.concatenate([[False], ids == image_token_id, [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    starts, ends = edges[0::2].tolist(), edges[1::2].tolist()
    if len(starts) != len(images):
        raise ValueError(
            f"{model}: the prompt has {len(starts)} run(s) of image tokens for {len(images)} image(s) "
            "(expand each image's placeholder to its num_tokens: engine.multimodal.expand_image_tokens)"
        )
    for i, (begin, end, image) in enumerate(zip(starts, ends, images)):
        if end - begin != image.num_tokens:
            raise ValueError(f"{model}: image {i} fills {image.num_tokens} tokens but its run has {end - begin}")
    return starts


def multimodal_rotary(
    num_tokens: int, images: list[ImageInput], starts: list[int], merge_size: int
) -> tuple[np.ndarray, int]:
    """Qwen2-VL's multimodal rotary positions of a prompt: text tokens count on from the position
    after what precedes them (all three rows equal); an image's tokens take (start, start + row,
    start + column) over its merged grid, and text after it continues from start + max(rows, columns).
    Returns ([3, num_tokens], the delta of the positions after the prompt)."""
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, current = 0, 0
    for image, first in zip(images, starts):
        text = first - cursor
        out[:, cursor:first] = np.arange(text) + current
        current += text
        t, h, w = image.grid_thw
        h, w = h // merge_size, w // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[:, first : first + image.num_tokens] = np.stack([tt, hh, ww]).reshape(3, -1) + current
        current += max(h, w)
        cursor = first + image.num_tokens
    out[:, cursor:] = np.arange(num_tokens - cursor) + current
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta


class ImageEmbeddingCache:
    """The vision encoder's output per image content hash, least recently used evicted first, within
    a budget of image tokens."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, content_hash: str) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: str) -> torch.Tensor | None:
        embeds = self._entries.get(content_hash)
        if embeds is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(content_hash)
        return embeds

    def put(self, content_hash: str, embeds: torch.Tensor) -> None:
        if content_hash in self._entries:
            return
        self._entries[content_hash] = embeds
        self._tokens += embeds.shape[0]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._tokens -= old.shape[0]


@dataclass(frozen=True)
class ImageSlice:
    """Part of an image's tokens that a step computes: image tokens [begin, end) at token rows
    [row, row + end - begin) of the step."""

    image: ImageInput
    begin: int
    end: int
    row: int


def step_images(entries: list, query_start_loc: np.ndarray) -> list[ImageSlice]:
    """The image tokens among a step's new tokens (entries: ScheduledBatch.seqs)."""
    slices = []
    for i, entry in enumerate(entries):
        mm = entry.seq.group.multimodal
        if mm is None or entry.start >= entry.seq.num_prompt_tokens:
            continue
        lo, hi = entry.start, entry.start + entry.num_new_tokens
        for image, first in zip(mm.images, mm.starts):
            begin, end = max(lo, first), min(hi, first + image.num_tokens)
            if begin < end:
                slices.append(ImageSlice(image, begin - first, end - first, int(query_start_loc[i]) + begin - lo))
    return slices


def step_rotary_positions(entries: list, positions: np.ndarray, query_start_loc: np.ndarray) -> np.ndarray | None:
    """The rotary positions of a step's tokens where a request has multimodal ones: [T] if every
    token's three rows agree (decodes: position + delta), else [3, T]; None without such requests.
    Tokens past their prompt (every decode) are set for the whole step at once; only the entries
    with prompt tokens (prefill chunks) read their request's table."""
    owners = [(i, entry.seq.group.multimodal) for i, entry in enumerate(entries)]
    owners = [(i, mm) for i, mm in owners if mm is not None and mm.rotary_positions is not None]
    if not owners:
        return None
    rows = np.broadcast_to(positions, (3, len(positions))).copy()
    index = np.fromiter((i for i, _ in owners), np.int64, len(owners))
    widths = np.fromiter((mm.rotary_positions.shape[1] for _, mm in owners), np.int64, len(owners))
    deltas = np.fromiter((mm.rotary_delta for _, mm in owners), np.int64, len(owners))
    starts, lengths = query_start_loc[index], query_start_loc[index + 1] - query_start_loc[index]
    tokens = np.arange(lengths.sum()) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    past = positions[tokens] >= np.repeat(widths, lengths)
    rows[:, tokens[past]] = positions[tokens[past]] + np.repeat(deltas, lengths)[past]
    for (i, mm), start, width in zip(owners, starts.tolist(), widths.tolist()):
        if positions[start] < width:  # prompt tokens (a token's position grows along its entry)
            _prompt_rotary(rows, positions, int(query_start_loc[i]), int(query_start_loc[i + 1]), mm)
    if (rows[0] == rows[1]).all() and (rows[0] == rows[2]).all():
        return rows[0].copy()
    return rows


def _prompt_rotary(rows: np.ndarray, positions: np.ndarray, q0: int, q1: int, mm) -> None:
    """rows[:, q0:q1] of one entry with prompt tokens: its table's, or position + delta past it."""
    seq_positions = positions[q0:q1]
    table = mm.rotary_positions
    in_prompt = seq_positions < table.shape[1]
    rows[:, q0:q1] = np.where(
        in_prompt, table[:, np.minimum(seq_positions, table.shape[1] - 1)], seq_positions + mm.rotary_delta
    )
