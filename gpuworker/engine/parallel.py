"""Tensor parallelism's processes: LLMEngine stays the one scheduler and sampler (rank 0, the driver)
and starts one worker process per other rank (Workers.start). Each step the driver sends the step's
shape to every worker through its pipe and the step's input tensors by one broadcast; every rank
then runs the same forward, whose collectives join the shards (models.tensor_parallel), and the same
logits gather; only the driver samples.

The pipes carry what is not a tensor: the resolved EngineConfig at start-up, each step's header, and
stop. The driver joins the process group only once every worker says it is joining, so slow starts
never count against the collectives' timeout. A worker waits on its pipe between steps however long
the engine idles, and exits when the driver goes (the pipe ends). A rank that dies makes the
driver's next step fail with a RuntimeError naming it; a collective that waits longer than
distributed_timeout_s (a rank hung) fails too.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from gpuworker.attention.backend import AttentionMetadata
from gpuworker.engine.config import EngineConfig
from gpuworker.engine.context_length import resolve_max_model_len, with_context
from gpuworker.engine.model_runner import ModelInputs, ModelRunner
from gpuworker.models.loader import load_model, load_model_config, resolve_dtype
from gpuworker.models.tensor_parallel import ParallelContext, shard_config

# NVLink multicast (NVLS) off: it reserves fabric memory per communicator and fails to initialise
# on hosts whose fabric manager does not grant it; plain NVLink rings cost little at our sizes.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
# How long a stopping worker gets to exit before it is killed.
STOP_GRACE_S = 10.0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the CPU, or the r-th GPU from `config.device`'s index."""
    device = torch.device(config.device)
    if device.type == "cpu":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_rank(config: EngineConfig, rank: int, store_path: str) -> ParallelContext:
    """Join the ranks' process group (rendezvous through a file, so no port is chosen)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed group: one tensor-parallel engine per process"
        )
    device = rank_device(config, rank)
    if device.type == "cuda":
        os.environ.update(NCCL_ENV)
        torch.cuda.set_device(device)
    world = config.tensor_parallel_size
    timeout = timedelta(seconds=config.distributed_timeout_s)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    return parallel_context(config, rank)


def parallel_context(config: EngineConfig, rank: int) -> ParallelContext:
    """What the model of rank `rank` is told about the split (models.tensor_parallel)."""
    dispatch = config.expert_parallel == "all_to_all"
    return ParallelContext(rank, config.tensor_parallel_size, dispatch_experts=dispatch)


@dataclass(frozen=True)
class StepHeader:
    """What a worker needs besides the broadcast tensors to run a step's forward."""

    num_tokens: int
    num_samples: int
    block_table_width: int
    num_decode_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: list[int]
    seq_lens: list[int]
    samples_every_row: bool

    @property
    def sizes(self) -> list[int]:
        """Lengths of the pieces of the broadcast int64 tensor: ids, positions, slots, sample
        indices, query_start_loc, seq_lens, block tables."""
        num_seqs = len(self.seq_lens)
        return [
            self.num_tokens,
            self.num_tokens,
            self.num_tokens,
            self.num_samples,
            num_seqs + 1,
            num_seqs,
            num_seqs * self.block_table_width,
        ]


def step_tensors(inputs: ModelInputs) -> tuple[StepHeader, torch.Tensor]:
    """The driver's side of a step: its header and its inputs packed into one int64 tensor."""
    meta = inputs.meta
    header = StepHeader(
        num_tokens=len(inputs.input_ids),
        num_samples=len(inputs.sample_indices),
        block_table_width=meta.block_tables.shape[1],
        num_decode_seqs=meta.num_decode_seqs,
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        query_start_loc=meta.query_start_loc_cpu,
        seq_lens=meta.seq_lens_cpu,
        samples_every_row=inputs.samples_every_row,
    )
    packed = torch.cat(
        [
            inputs.input_ids,
            inputs.positions,
            meta.slot_mapping,
            inputs.sample_indices,
            meta.query_start_loc.long(),
            meta.seq_lens.long(),
            meta.block_tables.long().reshape(-1),
        ]
    )
    return header, packed


def receive_step(header: StepHeader, device: torch.device) -> ModelInputs:
    """A worker's side of a step: the broadcast inputs, as the driver's runner made them."""
    packed = torch.empty(sum(header.sizes), dtype=torch.int64, device=device)
    dist.broadcast(packed, src=0)
    ids, positions, slots, sample_indices, query_start_loc, seq_lens, tables = packed.split(header.sizes)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start_loc.int(),
        seq_lens=seq_lens.int(),
        block_tables=tables.int().view(len(header.seq_lens), header.block_table_width),
        num_decode_seqs=header.num_decode_seqs,
        max_query_len=header.max_query_len,
        max_seq_len=header.max_seq_len,
        query_start_loc_cpu=header.query_start_loc,
        seq_lens_cpu=header.seq_lens,
    )
    return ModelInputs(
        input_ids=ids,
        positions=positions,
        meta=meta,
        sample_indices=sample_indices,
        samples_every_row=header.samples_every_row,
    )


class Workers:
    """The driver's handle on ranks 1..N-1: their processes and pipes, and this rank's context."""

    def __init__(
        self, config: EngineConfig, processes: list[multiprocessing.Process], pipes: list[Connection], store_dir: str
    ) -> None:
        self.config = config
        self.processes = processes
        self.pipes = pipes
        self.store_dir = store_dir
        self.context: ParallelContext | None = None
        self._stopped = False

    @classmethod
    def start(cls, config: EngineConfig) -> Workers:
        """Spawn ranks 1..N-1 and join their group as rank 0; each worker then loads its shard."""
        world = config.tensor_parallel_size
        if torch.device(config.device).type == "cuda":
            first = torch.device(config.device).index or 0
            if first + world > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size ({world}) from {config.device} needs GPUs {first}.."
                    f"{first + world - 1}; this host has {torch.cuda.device_count()}"
                )
            os.environ.update(NCCL_ENV)  # inherited by the workers before they import NCCL
        store_dir = tempfile.mkdtemp(prefix="gpuworker-tp-")
        store_path = os.path.join(store_dir, "store")
        spawn = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        workers = cls(config, [], [], store_dir)
        try:
            for rank in range(1, world):
                parent, child = spawn.Pipe()
                process = spawn.Process(
                    target=worker_main,
                    args=(config, rank, store_path, child),
                    name=f"tensor-parallel-rank-{rank}",
                    daemon=True,
                )
                process.start()
                child.close()  # the worker's end: the driver sees EOF when the worker is gone
                workers.processes.append(process)
                workers.pipes.append(parent)
            # Joined only once every worker has imported and is joining too: the group's timeout
            # is for collectives, not for starting processes, and a worker that dies starting is
            # seen at once (its pipe ends) instead of at the timeout.
            for rank in workers.ranks:
                workers._receive(rank, "joining")
            workers.context = init_rank(config, 0, store_path)
        except BaseException:
            workers.shutdown()
            raise
        return workers

    def free_device_bytes(self) -> list[int | None]:
        """Each worker's free device memory once its shard is loaded."""
        return [self._receive(rank, "loaded") for rank in self.ranks]

    def start_runners(self, config: EngineConfig) -> None:
        """Hand the workers the resolved config: each builds its KV cache (and warms up on CUDA, in
        step with the driver's warm-up)."""
        for rank in self.ranks:
            self._send(rank, ("config", config))

    def wait_ready(self) -> None:
        for rank in self.ranks:
            self._receive(rank, "ready")

    def send_step(self, inputs: ModelInputs) -> None:
        """Start a step on every worker: its header by pipe, its inputs by broadcast."""
        header, packed = step_tensors(inputs)
        for rank in self.ranks:
            self._send(rank, ("step", header))
        dist.broadcast(packed, src=0)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run a step's collectives; a failure names the ranks that are gone, if any."""
        self.check_alive()
        try:
            yield
        except RuntimeError as exc:
            gone = self.gone()
            detail = f"; {gone}" if gone else ""
            raise RuntimeError(f"tensor-parallel step failed: {exc}{detail}") from exc

    def check_alive(self) -> None:
        if self._stopped:
            raise RuntimeError("the tensor-parallel workers have been shut down")
        gone = self.gone()
        if gone:
            raise RuntimeError(f"tensor-parallel {gone}: the engine cannot run steps without it")

    def shutdown(self) -> None:
        """Stop the workers (killing any that do not exit) and leave the process group."""
        if self._stopped:
            return
        self._stopped = True
        for pipe in self.pipes:
            try:
                pipe.send(("stop", None))
            except OSError:
                pass  # already gone
            pipe.close()
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.store_dir, ignore_errors=True)

    @property
    def ranks(self) -> range:
        return range(1, len(self.processes) + 1)

    def gone(self) -> str:
        """The ranks whose process has exited, as a person reads them; "" while all run."""
        gone = [
            f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in zip(self.ranks, self.processes)
            if p.exitcode is not None
        ]
        return ", ".join(gone)

    def _send(self, rank: int, message: tuple) -> None:
        try:
            self.pipes[rank - 1].send(message)
        except OSError as exc:
            self.processes[rank - 1].join(STOP_GRACE_S)
            raise RuntimeError(f"tensor-parallel rank {rank} is gone ({self.gone() or exc})") from exc

    def _receive(self, rank: int, kind: str):
        """The payload of the worker's next message, which must be `kind`; its error, raised here."""
        try:
            got, payload = self.pipes[rank - 1].recv()
        except (EOFError, OSError) as exc:
            self.processes[rank - 1].join(STOP_GRACE_S)
            raise RuntimeError(f"tensor-parallel rank {rank} is gone before {kind!r} ({self.gone() or exc})") from exc
        if got == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed: {payload}")
        if got != kind:
            raise RuntimeError(f"tensor-parallel rank {rank} sent {got!r}, expected {kind!r}")
        return payload


def worker_main(config: EngineConfig, rank: int, store_path: str, pipe: Connection) -> None:
    """A worker rank's process: load its shard, build its KV cache, then run each step the driver
    sends until it says stop or goes away."""
    try:
        _serve(config, rank, store_path, pipe)
    except (EOFError, BrokenPipeError):
        pass  # the driver is gone: nothing is left to serve
    except BaseException:
        try:
            pipe.send(("error", traceback.format_exc(limit=8)))
        except OSError:
            pass
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(config: EngineConfig, rank: int, store_path: str, pipe: Connection) -> None:
    pipe.send(("joining", None))
    parallel = init_rank(config, rank, store_path)
    device = rank_device(config, rank)
    mc = load_model_config(config.model)
    mc = with_context(mc, resolve_max_model_len(config, mc))
    dtype = resolve_dtype(config.dtype, mc)
    backend = None
    if device.type == "cuda":
        from gpuworker.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend()
    model = load_model(
        mc,
        device=device,
        dtype=dtype,
        attn_backend=backend,
        load_format=config.load_format,
        seed=config.seed,
        quantization=config.quantization,
        parallel=parallel,
    )
    free = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
    pipe.send(("loaded", free))
    kind, resolved = pipe.recv()
    if kind != "config":
        return
    runner = ModelRunner(resolved, shard_config(mc, parallel), model, device, dtype)
    if device.type == "cuda":
        runner.warm_up()
    pipe.send(("ready", None))
    while True:
        kind, header = pipe.recv()
        if kind != "step":
            return
        with torch.inference_mode():
            _run_step(runner, header)


def _run_step(runner: ModelRunner, header: StepHeader) -> None:
    """A worker's part of one step: the forward, and the logits gather when the driver samples."""
    inputs = receive_step(header, runner.device)
    model = runner.model
    hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
    if header.num_samples:
        model.compute_logits(hidden if inputs.samples_every_row else hidden[inputs.sample_indices])
