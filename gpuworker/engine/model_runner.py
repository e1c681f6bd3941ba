"""The model runner: owns the KV cache, turns a ScheduledBatch into one ragged forward, samples.

Per step: the batch's metadata built with numpy (block tables kept across steps in BlockTables) and
copied to the device without blocking (from pinned memory on CUDA), one forward over all
sequences' new tokens, logits only for the rows that sample, then exactly one device->host
transfer of the sampled ids (packed with logprobs when asked for). `launch` enqueues all of that
and returns at once; `wait` blocks on the transfer. With async scheduling the engine launches step
N+1 before waiting for step N: a decode input whose token is still a placeholder is read from step
N's sampled ids on the device. A step with grammar-constrained rows is launched with its sampling
deferred: the engine builds the token mask on the host while the forward runs, then `sample`
enqueues the rest. `forward` is the seam where decode-only batches are replayed from CUDA graphs:
their inputs go in one copy into the graphs' own buffer, and greedy steps write their ids where
the next replay reads its placeholders (cuda_graphs.GraphInputs), so such a step is one copy, one
replay, the lm_head with its argmax, and the copy back. Eager steps take two copies (one per
dtype) and gather their placeholders with torch ops.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.engine.block_tables import BlockTables
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.grammar_masks import TokenBitmask
from gpuworker.engine.host_kv_pool import HostKVPool
from gpuworker.engine.kv_cache_dtype import kv_cache_torch_dtype
from gpuworker.engine.multimodal import ImageEmbeddingCache, ImageSlice, step_images, step_rotary_positions
from gpuworker.engine.outputs import TokenLogprob
from gpuworker.engine.sampling import Sampler, SamplingMetadata, to_device
from gpuworker.engine.scheduler import ScheduledBatch
from gpuworker.engine.sequence import PLACEHOLDER_TOKEN_ID, Sequence
from gpuworker.engine.sizing import MAX_ENCODER_PATCHES, image_cache_tokens
from gpuworker.models.config import ModelConfig

# torch.profiler ranges at the step's phase boundaries (bench/vision.py --profile attributes device
# time by them; a range costs a few microseconds when no profiler runs). A vision encoder call runs
# inside a prefill step's range: the innermost range names the phase.
PREFILL_STEP_RANGE = "engine: prefill step"
DECODE_STEP_RANGE = "engine: decode step"
VISION_ENCODER_RANGE = "engine: vision encoder"


class RankWorkers(Protocol):
    """The other tensor-parallel ranks, as the runner drives them (engine.parallel.Workers)."""

    def guard(self) -> AbstractContextManager[None]: ...

    def send_step(self, inputs: ModelInputs) -> None: ...


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [S] int64: the token row whose hidden state each sample uses
    # Every token row samples, in order (a decode-only step): the hidden states need no gather.
    samples_every_row: bool = False
    # Image embeddings that replace the token embeddings at these rows (a vision model's prefill).
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


@dataclass
class HostInputs:
    """A step's inputs on the host (numpy), before they go to the device."""

    ids: np.ndarray  # [T] int64, PLACEHOLDER_TOKEN_ID where the token is still on the device
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    sample_indices: np.ndarray  # [S] int64
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, width] int32
    num_decode_seqs: int
    max_query_len: int
    placeholders: np.ndarray  # token rows whose id is a placeholder
    placeholder_seqs: list[Sequence]  # the sequence of each
    # With a window pool (sliding layers' blocks, engine.window_blocks): its slots and tables.
    window_slot_mapping: np.ndarray | None = None  # [T] int64
    window_block_tables: np.ndarray | None = None  # [B, width] int32
    # With images (engine.multimodal): rotary positions other than `positions` ([T] or [3, T]) and
    # the image tokens the step computes.
    rotary_positions: np.ndarray | None = None
    images: list[ImageSlice] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    @property
    def samples_every_row(self) -> bool:
        return len(self.sample_indices) == len(self.ids)


@dataclass
class StepHandle:
    """A launched step whose sampled tokens may still be on their way to the host."""

    batch: ScheduledBatch
    sample_seqs: list[Sequence]
    token_ids: torch.Tensor | None  # [S] on the device: the next step's inputs may read them
    # What comes back to the host: the ids, or ids packed with logprobs (float64 rows).
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    max_logprobs: int | None
    # A launch with deferred sampling holds its logits until `ModelRunner.sample` is called.
    logits: torch.Tensor | None = None
    sampling_meta: SamplingMetadata | None = None
    _row_of: dict[int, int] | None = None

    def row_of(self) -> dict[int, int]:
        """seq_id -> the row of its sampled token (built once per step)."""
        if self._row_of is None:
            self._row_of = {seq.seq_id: row for row, seq in enumerate(self.sample_seqs)}
        return self._row_of


@dataclass
class StepResult:
    # One per sampling entry of the batch, in batch order.
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        mc: ModelConfig,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        workers: RankWorkers | None = None,
    ) -> None:
        """mc: the shapes this rank holds (models.tensor_parallel.shard_config); workers: the other
        tensor-parallel ranks, which run each eager forward with this one (engine.parallel)."""
        if not config.is_resolved:
            raise ValueError("the model runner needs a resolved config (see EngineConfig.is_resolved)")
        self.config = config
        self.model_config = mc
        self.model = model
        self.workers = workers
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self._allocate_kv_cache(config, mc, dtype, device)
        # The host tier's slots (engine.host_kv_pool); None without one.
        self.host_kv = HostKVPool(self.kv_cache, config.num_host_kv_blocks) if config.num_host_kv_blocks else None
        self.sampler = Sampler(device, config.seed)
        # A vision model's encoder output by image content hash (engine.multimodal).
        self.image_cache = ImageEmbeddingCache(max_tokens=image_cache_tokens(config.max_num_batched_tokens))
        max_blocks = -(-config.max_model_len // config.block_size)
        self.block_tables = BlockTables(2 * config.max_num_seqs + 8, max_blocks)
        self.window_tables = (
            BlockTables(2 * config.max_num_seqs + 8, max_blocks, window=True) if self.window_cache is not None else None
        )
        self.decode_graphs = None
        self.graph_capture_s = 0.0
        # Only a backend that never reads device values on the host can be captured.
        backend_name = getattr(getattr(model, "attn_backend", None), "name", "")
        # A split model runs eagerly: its collectives are not captured.
        unsplit = getattr(model, "parallel", None) is None
        if device.type == "cuda" and not config.enforce_eager and backend_name == "triton" and unsplit:
            from gpuworker.engine.cuda_graphs import DecodeGraphs

            started = time.perf_counter()
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                block_size=config.block_size,
                defer=config.defer_warm_up,
                windowed=self.window_cache is not None,
            )
            self.graph_capture_s = round(time.perf_counter() - started, 4)

    def _allocate_kv_cache(
        self, config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The KV pool: one tensor, each layer a view [planes, blocks, block_size, heads, width]
        (mc.kv_cache_layout: [2, ..., kv_heads, head_dim] for keys and values, [1, ..., 1, latent +
        rope] for latent attention), kv_caches in layer order. With a window pool
        (config.window_pool), the sliding layers' views are of a second tensor of that pool's blocks
        (window_cache)."""
        kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, dtype, device)
        planes, heads, width = mc.kv_cache_layout
        shape = (config.block_size, heads, width)
        sliding = [w is not None for w in mc.layer_windows] if config.window_pool else [False] * mc.num_layers
        num_sliding = sum(sliding)
        self.kv_cache = torch.zeros(
            mc.num_layers - num_sliding, planes, config.num_kv_blocks, *shape, dtype=kv_dtype, device=device
        )
        self.window_cache = None
        if num_sliding:
            self.window_cache = torch.zeros(
                num_sliding, planes, config.num_window_kv_blocks, *shape, dtype=kv_dtype, device=device
            )
        full, windowed = (
            iter(self.kv_cache.unbind(0)),
            iter(() if self.window_cache is None else self.window_cache.unbind(0)),
        )
        self.kv_caches = [next(windowed) if slides else next(full) for slides in sliding]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile the eager path's kernels now rather than during the first requests (a second or
        more each on a GPU): one step of made-up tokens, the logits and sampling of its rows, then
        the kernels the model picks by shape at run time, which the model warms up itself. It
        writes no KV, so it may run between steps while sequences hold blocks
        (EngineConfig.defer_warm_up)."""
        hidden = self._warm_up_step()
        self._warm_up_sampling(hidden)
        self.model.warm_up(self.kv_caches[0], self.config.max_model_len, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_step(self) -> torch.Tensor:
        """One eager forward of a decode and a prefill chunk side by side, with the shortest context
        and with the longest; its slots are all -1, so it writes no KV. Its hidden states."""
        bs = self.block_size
        chunk = max(1, min(32, self.config.max_num_batched_tokens - 1, self.config.max_model_len - 1))
        num_blocks = min(self.config.num_kv_blocks, -(-chunk // bs))
        # As wide as the longest context, so the decode kernel can be sized for it too.
        table = [i % num_blocks for i in range(-(-self.config.max_model_len // bs))]
        positions = [0] + list(range(chunk))
        slots = [-1] * (1 + chunk)
        device = self.device
        input_ids = torch.zeros(1 + chunk, dtype=torch.int64, device=device)
        # max_seq_len is the host's bound on the contexts: a short one runs the decode kernel in one
        # partition, the longest one split along the context (its two variants).
        positions_t = torch.tensor(positions, dtype=torch.int64, device=device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, 1, 1 + chunk], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([1, chunk], dtype=torch.int32, device=device),
            block_tables=torch.tensor([table, table], dtype=torch.int32, device=device),
            num_decode_seqs=1,
            max_query_len=chunk,
            max_seq_len=chunk,
            query_start_loc_cpu=[0, 1, 1 + chunk],
            seq_lens_cpu=[1, chunk],
        )
        if self.window_cache is not None:  # the same few blocks, which every pool has
            meta.windowed = replace(meta)
        for max_seq_len in (chunk, self.config.max_model_len):
            hidden = self.model(input_ids, positions_t, self.kv_caches, replace(meta, max_seq_len=max_seq_len))
        return hidden

    def _warm_up_sampling(self, hidden: torch.Tensor) -> None:
        """The logits and greedy tokens of one row and of two (the warm-up step's `hidden`), and on
        the GPU the sampler's common variants."""
        last = hidden.shape[0] - 1
        for rows in ([last], [0, last]):
            selected = hidden[torch.tensor(rows, device=self.device)]
            self.model.compute_logits(selected).argmax(dim=-1)
            self.model.greedy_tokens(selected)
        if self.device.type == "cuda":
            from gpuworker.kernels.sampling.sample import warm_up as warm_up_sampling

            warm_up_sampling(self.device, self.model_config.vocab_size)

    def launch(
        self, batch: ScheduledBatch, previous: StepHandle | None = None, defer_sampling: bool = False
    ) -> StepHandle:
        """Enqueue one step on the device; `previous` supplies tokens still held as placeholders.

        defer_sampling: enqueue only the forward pass and the logits, and return; the caller then
        calls `sample` (with a grammar's token mask built on the host meanwhile).
        """
        if self.workers is None:
            return self._launch(batch, previous, defer_sampling)
        with self.workers.guard():
            return self._launch(batch, previous, defer_sampling)

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch, previous: StepHandle | None, defer_sampling: bool) -> StepHandle:
        with record_function(DECODE_STEP_RANGE if batch.num_decode_seqs == len(batch.seqs) else PREFILL_STEP_RANGE):
            return self._launch_step(batch, previous, defer_sampling)

    def _launch_step(self, batch: ScheduledBatch, previous: StepHandle | None, defer_sampling: bool) -> StepHandle:
        host = self.host_inputs(batch)
        sample_seqs = [entry.seq for entry in batch.seqs if entry.samples]
        sampling_meta = (
            self.sampler.metadata(sample_seqs, self.model_config.vocab_size, self.model_config.eos_token_ids)
            if sample_seqs
            else None
        )
        rows = self.forward(host, batch, previous)
        if sampling_meta is None:
            return StepHandle(batch, [], None, None, None, None)
        if sampling_meta.plain_argmax and not defer_sampling:
            # Greedy without extras: the argmax comes with the lm_head, no float32 logits. With
            # decode graphs the ids land where the next replay reads its placeholders.
            handle = StepHandle(batch, sample_seqs, None, None, None, None)
            graphs = self.decode_graphs
            out = graphs.sampled[: len(sample_seqs)] if graphs is not None else None
            self._send_to_host(handle, self.model.greedy_tokens(rows, out=out))
            return handle
        handle = StepHandle(
            batch,
            sample_seqs,
            None,
            None,
            None,
            sampling_meta.max_logprobs,
            logits=self.model.compute_logits(rows),
            sampling_meta=sampling_meta,
        )
        if not defer_sampling:
            self.sample(handle)
        return handle

    @torch.inference_mode()
    def sample(self, handle: StepHandle, allowed: TokenBitmask | None = None) -> None:
        """Enqueue the sampling of a launched step and the transfer of its tokens to the host;
        `allowed` restricts the constrained rows to the tokens their grammars allow."""
        if handle.logits is None or handle.sampling_meta is None:
            raise RuntimeError("this step has no logits waiting to be sampled")
        logits, sampling_meta = handle.logits, handle.sampling_meta
        handle.logits = handle.sampling_meta = None
        out = self.sampler(logits, sampling_meta, allowed)
        if out.logprobs is None:
            self._send_to_host(handle, out.token_ids)
        else:
            # ids are exact in float64, so one transfer carries everything.
            self._send_to_host(
                handle,
                out.token_ids,
                torch.cat(
                    [
                        out.token_ids[:, None].double(),
                        out.logprobs[:, None].double(),
                        out.top_ids.double(),
                        out.top_logprobs.double(),
                    ],
                    dim=1,
                ),
            )

    def _send_to_host(self, handle: StepHandle, token_ids: torch.Tensor, result: torch.Tensor | None = None) -> None:
        """Enqueue the one device->host transfer of a step: its ids, or `result` packing them with
        logprobs. The ids stay on the device for the next step's placeholders."""
        if result is None:
            result = token_ids
        ready = None
        if self.device.type == "cuda":
            host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
            host.copy_(result, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = result
        handle.token_ids, handle.host, handle.ready = token_ids, host, ready

    def wait(self, handle: StepHandle) -> StepResult:
        if handle.logits is not None:
            raise RuntimeError("this step's sampling was deferred and never enqueued")
        if handle.host is None:
            return StepResult([], [])
        if handle.ready is not None:
            handle.ready.synchronize()
        if handle.max_logprobs is None:
            return StepResult(handle.host.tolist(), [None] * len(handle.sample_seqs))
        return self._unpack(handle.host.tolist(), handle.sample_seqs, handle.max_logprobs)

    def forward(self, host: HostInputs, batch: ScheduledBatch, previous: StepHandle | None = None) -> torch.Tensor:
        """The forward pass of a step: the hidden states of its sampling rows [S, hidden_size].

        A decode-only step replays a CUDA graph (one copy of its inputs, one launch); any other
        runs eagerly from the device tensors of prepare_inputs."""
        graphs = self.decode_graphs
        rotary = host.rotary_positions
        if (
            graphs is not None
            and not host.images
            and (rotary is None or rotary.ndim == 1)
            and graphs.can_run(host.num_decode_seqs, host.num_seqs, len(host.ids), host.max_seq_len)
        ):
            sampled_rows = self._placeholder_rows(host, previous)
            if sampled_rows.size and previous.token_ids.data_ptr() != graphs.sampled.data_ptr():
                graphs.sampled[: len(previous.token_ids)].copy_(previous.token_ids)
            # One token per sequence and every one samples: the rows are the hidden states.
            return graphs.run(
                known_ids=host.ids,
                placeholders=host.placeholders,
                sampled_rows=sampled_rows,
                positions=host.positions if rotary is None else rotary,
                slot_mapping=host.slot_mapping,
                seq_lens=host.seq_lens,
                block_tables=host.block_tables,
                window_slot_mapping=host.window_slot_mapping,
                window_block_tables=host.window_block_tables,
            )
        inputs = self.prepare_inputs(batch, previous, host=host)
        if self.workers is not None:
            self.workers.send_step(inputs)
        if inputs.image_rows is None:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        else:
            hidden = self.model(
                inputs.input_ids,
                inputs.positions,
                self.kv_caches,
                inputs.meta,
                image_rows=inputs.image_rows,
                image_embeds=inputs.image_embeds,
            )
        return hidden if inputs.samples_every_row else hidden[inputs.sample_indices]

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """Flatten the batch's new tokens (decodes first, as the batch is ordered) into one sequence.

        Per sequence only its new token ids are gathered in Python; positions, slots, query offsets
        and the block tables are computed with numpy over the whole batch."""
        bs = self.block_size
        entries = batch.seqs
        num_seqs = len(entries)
        input_ids: list[int] = []
        for seq, start, num_new, _ in entries:
            if num_new == 1:
                input_ids.append(seq.token_ids[start])
            else:
                input_ids += seq.token_ids[start : start + num_new]
        starts = np.fromiter((entry.start for entry in entries), np.int64, num_seqs)
        new_lens = np.fromiter((entry.num_new_tokens for entry in entries), np.int64, num_seqs)
        samples = np.fromiter((entry.samples for entry in entries), np.bool_, num_seqs)
        rows = self.block_tables.rows([entry.seq for entry in entries])
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(new_lens, out=query_start_loc[1:])
        seq_lens = starts + new_lens
        num_tokens = len(input_ids)
        if num_tokens == num_seqs:  # decode-only: one token per sequence
            positions, token_rows = starts, rows
        else:
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - query_start_loc[:-1], new_lens)
            token_rows = np.repeat(rows, new_lens)
        tables = self.block_tables.array
        slot_mapping = tables[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        window_slots = window_tables = None
        if self.window_tables is not None:
            window_rows = self.window_tables.rows([entry.seq for entry in entries])
            array = self.window_tables.array
            window_token_rows = window_rows if num_tokens == num_seqs else np.repeat(window_rows, new_lens)
            window_slots = array[window_token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        sample_indices = query_start_loc[1:][samples] - 1
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // bs)
        if window_slots is not None:
            window_tables = self.window_tables.gather(window_rows, num_blocks)
        ids = np.array(input_ids, dtype=np.int64)
        placeholders = np.flatnonzero(ids == PLACEHOLDER_TOKEN_ID)
        # The entry each placeholder belongs to.
        owners = (
            placeholders if num_tokens == num_seqs else np.searchsorted(query_start_loc, placeholders, side="right") - 1
        )
        in_chunks = owners[new_lens[owners] != 1]
        if in_chunks.size:
            # Only a decode's one input token can still be in flight.
            raise RuntimeError(f"{entries[int(in_chunks[0])].seq}: a prefill chunk ends in a token not yet sampled")
        multimodal = any(entry.seq.group.multimodal is not None for entry in entries)
        return HostInputs(
            rotary_positions=step_rotary_positions(entries, positions, query_start_loc) if multimodal else None,
            images=step_images(entries, query_start_loc) if multimodal else [],
            ids=ids,
            positions=positions,
            slot_mapping=slot_mapping,
            sample_indices=sample_indices,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_tables.gather(rows, num_blocks),
            num_decode_seqs=batch.num_decode_seqs,
            max_query_len=int(new_lens.max()),
            placeholders=placeholders,
            placeholder_seqs=[entries[i].seq for i in owners.tolist()],
            window_slot_mapping=window_slots,
            window_block_tables=window_tables,
        )

    def prepare_inputs(
        self, batch: ScheduledBatch, previous: StepHandle | None = None, host: HostInputs | None = None
    ) -> ModelInputs:
        """The device tensors of an eager step (`host`: the batch's host_inputs, if already made)."""
        if host is None:
            host = self.host_inputs(batch)
        num_seqs, width = host.block_tables.shape
        # Two host->device copies per step (one per dtype), sliced into the metadata on the device.
        input_ids_t, positions_t, slot_mapping_t, sample_indices_t = _packed_to_device(
            [host.ids, host.positions, host.slot_mapping, host.sample_indices], torch.int64, self.device
        )
        query_start_loc_t, seq_lens_t, tables_t = _packed_to_device(
            [host.query_start_loc, host.seq_lens, host.block_tables.reshape(-1)], torch.int32, self.device
        )
        meta = AttentionMetadata(
            slot_mapping=slot_mapping_t,
            query_start_loc=query_start_loc_t,
            seq_lens=seq_lens_t,
            block_tables=tables_t.view(num_seqs, width),
            num_decode_seqs=host.num_decode_seqs,
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            query_start_loc_cpu=host.query_start_loc.tolist(),
            seq_lens_cpu=host.seq_lens.tolist(),
        )
        if host.window_slot_mapping is not None:
            (window_slots_t,) = _packed_to_device([host.window_slot_mapping], torch.int64, self.device)
            (window_tables_t,) = _packed_to_device([host.window_block_tables.reshape(-1)], torch.int32, self.device)
            meta.windowed = replace(
                meta, slot_mapping=window_slots_t, block_tables=window_tables_t.view(num_seqs, width)
            )
        if host.placeholders.size:
            # The tokens still held as placeholders, from the previous step's sampled ids.
            sampled_rows = self._placeholder_rows(host, previous)
            input_ids_t[to_device(host.placeholders, torch.int64, self.device)] = previous.token_ids[
                to_device(sampled_rows, torch.int64, self.device)
            ]
        inputs = ModelInputs(
            input_ids=input_ids_t,
            positions=positions_t,
            meta=meta,
            sample_indices=sample_indices_t,
            samples_every_row=host.samples_every_row,
        )
        if host.rotary_positions is not None:
            inputs.positions = to_device(np.ascontiguousarray(host.rotary_positions), torch.int64, self.device)
        if host.images:
            inputs.image_rows, inputs.image_embeds = self.image_embeddings(host.images)
            if getattr(self.model, "attends_within_images", False):  # Gemma 3
                meta.span_ends = to_device(image_span_ends(host), torch.int32, self.device)
                if meta.windowed is not None:
                    meta.windowed.span_ends = meta.span_ends
        return inputs

    def image_embeddings(self, images: list[ImageSlice]) -> tuple[torch.Tensor, torch.Tensor]:
        """The token rows of a step's image tokens and their embeddings: images not in the cache are
        encoded together in one batch on the device, then each slice is taken from the cache."""
        cache = self.image_cache
        missing: dict[str, object] = {}
        for part in images:
            if part.image.content_hash not in cache and part.image.content_hash not in missing:
                missing[part.image.content_hash] = part.image
        fresh: dict[str, torch.Tensor] = {}
        for group in encoder_batches(list(missing.values()), self.model_config.vision.patch_values):
            with record_function(VISION_ENCODER_RANGE):
                pixels = torch.cat([image.pixel_values for image in group]).to(self.device, non_blocking=True)
                encoded = self.model.encode_images(pixels, [image.grid_thw for image in group])
            for image, embeds in zip(group, encoded.split([image.num_tokens for image in group])):
                cache.put(image.content_hash, embeds)
                fresh[image.content_hash] = embeds
        rows, embeds = [], []
        for part in images:
            full = fresh.get(part.image.content_hash)
            if full is None:
                full = cache.get(part.image.content_hash)
            rows.append(np.arange(part.row, part.row + part.end - part.begin))
            embeds.append(full[part.begin : part.end])
        return to_device(np.concatenate(rows), torch.int64, self.device), torch.cat(embeds)

    @staticmethod
    def _placeholder_rows(host: HostInputs, previous: StepHandle | None) -> np.ndarray:
        """For each placeholder of the step, the row of the previous step's sampled ids holding it."""
        if not host.placeholders.size:
            return host.placeholders
        rows = previous.row_of() if previous is not None and previous.token_ids is not None else {}
        src = []
        for seq in host.placeholder_seqs:
            row = rows.get(seq.seq_id)
            if row is None:
                raise RuntimeError(f"{seq}: its input token was not sampled by the previous step")
            src.append(row)
        return np.array(src, dtype=np.int64)

    @staticmethod
    def _unpack(packed: list[list[float]], seqs: list, max_logprobs: int) -> StepResult:
        token_ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        for row, seq in zip(packed, seqs):
            token_ids.append(int(row[0]))
            wanted = seq.group.params.logprobs
            if wanted is None:
                logprobs.append(None)
                continue
            top_ids, top_values = row[2 : 2 + max_logprobs], row[2 + max_logprobs :]
            logprobs.append(
                TokenLogprob(
                    token_id=int(row[0]),
                    logprob=row[1],
                    top_logprobs=[(int(i), v) for i, v in zip(top_ids[:wanted], top_values[:wanted])],
                )
            )
        return StepResult(token_ids, logprobs)


def encoder_batches(images: list, patch_values: int) -> list[list]:
    """The images to encode, in groups of at most MAX_ENCODER_PATCHES patch rows (an image larger
    than that alone); an image's rows are its pixel values over `patch_values` (the vision
    layout's), whether its processor gave them as patch rows (Qwen2.5-VL) or as one picture (Gemma 3)."""
    groups: list[list] = []
    rows = 0
    for image in images:
        patches = image.pixel_values.numel() // patch_values
        if not groups or rows + patches > MAX_ENCODER_PATCHES:
            groups.append([])
            rows = 0
        groups[-1].append(image)
        rows += patches
    return groups


def image_span_ends(host: HostInputs) -> np.ndarray:
    """AttentionMetadata.span_ends of a step whose image tokens attend within their image: an image
    token's last visible position is its image's last, every other token's its own. Each image ends
    in the step (the scheduler never cuts one)."""
    ends = host.positions.astype(np.int32)
    for part in host.images:
        if part.end != part.image.num_tokens:
            raise RuntimeError("a prefill chunk ends inside an image that must be computed whole")
        last = part.row + part.end - part.begin - 1
        ends[part.row : last + 1] = host.positions[last]
    return ends


def _packed_to_device(arrays: list[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Copy arrays to the device in one transfer; returns one device view per array.

    Every view starts 16-byte aligned, whatever the lengths before it: Triton compiles a kernel
    variant per alignment pattern of its pointer arguments, and unaligned slices would make new
    batch sizes compile new variants mid-run."""
    per_16_bytes = 16 // dtype.itemsize
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += -(-len(array) // per_16_bytes) * per_16_bytes
    packed = torch.zeros(total, dtype=dtype).numpy()
    for array, offset in zip(arrays, offsets):
        packed[offset : offset + len(array)] = array
    flat = to_device(packed, dtype, device)
    return [flat[offset : offset + len(array)] for array, offset in zip(arrays, offsets)]
