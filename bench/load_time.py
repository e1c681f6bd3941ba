"""Load time: from the load task to a ready replica, through the real path, for a full-size checkpoint.

    python bench/load_time.py --dir /data/llama-3-8b-random [--cold] [--hf] [--baseline-tree DIR]
                              [--spare-runs N] [--readers 4,8,16]

Writes random weights for the Llama-3-8B config (bench/configs/llama-3-8b) in the real Hugging Face
layout once (bf16 safetensors in 4 shards, model.safetensors.index.json, config.json, a byte-level
tokenizer), then times `python -m gpuworker serve` started as the daemon starts it, polling /health
until ready. The replica's /health reports its stages (CUDA init, weights, KV pool, CUDA graphs,
warm-up); process start and imports are the time from spawn to the engine's start. Each run is
made with the page cache warm, and with --cold also after dropping the files' pages
(posix_fadvise DONTNEED, per file), next to the disk's own sequential read of the same files
cold (the reference). --hf times transformers' from_pretrained onto the GPU in a fresh process;
--baseline-tree DIR runs the same replica path from another checkout (the code before a change).
--spare-runs N times the daemon's path with a spare replica process (gpuworker/replica/spare.py):
the real Supervisor with spares on, the load handed over once the spare is ready, as on a worker
whose spare started long before the load; time = the load command -> /health ready, and -> the
reply to a 16-token completion sent at ready (the replica warms up after ready, between steps).
--readers times the loader alone (weights into the model, in this process, nothing else running)
with that many reader threads, to separate the copy's own speed from contention in the replica.
An untimed first start fills Triton's kernel cache, as on any worker that served before.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    DEFAULT_CONFIG,
    READY_DEADLINE_S,
    environment,
    print_table,
    start_replica,
    stop_replica,
    wait_ready,
    write_checkpoint,
)
from gpuworker.checkpoint_files import advise, checkpoint_files  # noqa: E402

READ_BYTES = 16 << 20


def drop_cache(directory: Path) -> None:
    advise(checkpoint_files(directory), os.POSIX_FADV_DONTNEED)


def sequential_read(directory: Path) -> tuple[float, int]:
    """Seconds to read every weight file once, in order, with large reads; and the bytes read."""
    buffer, total = bytearray(READ_BYTES), 0
    started = time.perf_counter()
    for file in checkpoint_files(directory):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return time.perf_counter() - started, total


def serve_once(tree: Path, model: Path, device: str, log: Path) -> dict:
    """Spawn the replica as the daemon does and poll /health until ready: the run's timings."""
    spawned_wall, spawned = time.time(), time.perf_counter()
    process, url = start_replica(model, device=device, dtype="bfloat16", log=log, tree=tree)
    try:
        health = wait_ready(process, url, log)
        ready_s = time.perf_counter() - spawned
    finally:
        stop_replica(process)
    result = {"ready_s": round(ready_s, 3)}
    if health.get("load_started_at"):
        result["process_start_and_imports_s"] = round(health["load_started_at"] - spawned_wall, 3)
    result |= health.get("load_timings") or {}
    return result


def spare_once(model: Path, device: str, state_dir: Path) -> dict:
    """The daemon's path with a spare: load into the Supervisor's ready spare, poll /health until ready."""
    import httpx

    from gpuworker.contract.spare_handover import READY_LINE
    from gpuworker.contract.tasks import LoadModel
    from gpuworker.daemon.supervisor import Supervisor

    gpu_index = int(device.split(":")[1]) if device.startswith("cuda:") else (0 if device == "cuda" else None)
    token = "bench"
    supervisor = Supervisor(
        token=token,
        gpu_count=0 if gpu_index is None else gpu_index + 1,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=state_dir,
        worker_name="bench",
        model_roots=(model.parent,),
        spare_replicas=True,
    )
    spare_log = state_dir / "replicas" / f"spare-{'cpu' if gpu_index is None else f'cuda-{gpu_index}'}.log"
    supervisor.start()
    try:
        deadline = time.perf_counter() + READY_DEADLINE_S
        while not (spare_log.is_file() and READY_LINE in spare_log.read_text()):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the spare never got ready; see {spare_log}")
            time.sleep(0.05)
        started_wall, started = time.time(), time.perf_counter()
        supervisor.load(
            LoadModel(
                replica_id=1,
                model_path=str(model),
                served_model_name="bench",
                gpu_index=gpu_index,
                memory_fraction=0.9,
                dtype="bfloat16",
            )
        )
        with httpx.Client(timeout=2.0, headers={"Authorization": f"Bearer {token}"}) as client:
            while True:
                if time.perf_counter() > deadline:
                    raise RuntimeError("no ready replica in time")
                entry = next((r for r in supervisor.snapshot() if r.replica_id == 1), None)
                if entry is not None and entry.state == "failed":
                    raise RuntimeError(f"the replica failed: {entry.error}")
                health = {}
                if entry is not None and entry.endpoint_url:
                    try:
                        health = client.get(f"{entry.endpoint_url}/health").json()
                    except (httpx.HTTPError, ValueError):
                        pass
                if health.get("status") == "ready":
                    ready_s = time.perf_counter() - started
                    break
                time.sleep(0.02)
            # A request sent the moment it is ready waits for whatever warm-up piece is running
            # (EngineConfig.defer_warm_up): its completion time is the honest "serving" figure.
            reply = client.post(
                f"{entry.endpoint_url}/v1/completions",
                timeout=60.0,
                json={"model": "bench", "prompt": "Hello", "max_tokens": 16, "ignore_eos": True},
            )
            reply.raise_for_status()
            first_completion_s = time.perf_counter() - started
    except Exception:
        for log in sorted((state_dir / "replicas").glob("*.log")):
            print(f"--- {log.name} (end) ---\n{log.read_text()[-3000:]}", flush=True)
        raise
    finally:
        supervisor.close(drain_timeout_s=1)
    result = {"ready_s": round(ready_s, 3), "first_16_tokens_s": round(first_completion_s, 3)}
    if health.get("load_started_at"):
        result["handover_to_engine_start_s"] = round(health["load_started_at"] - started_wall, 3)
    return result | (health.get("load_timings") or {})


def loader_alone(model_dir: Path, device: str, readers: int) -> dict:
    """Seconds for load_model (weights only, in this process) with `readers` reader threads."""
    import torch

    from gpuworker.models import weight_stream
    from gpuworker.models.loader import load_model

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    default, weight_stream.MAX_READERS = weight_stream.MAX_READERS, readers
    try:
        sync()
        started = time.perf_counter()
        model = load_model(model_dir, device=device, dtype=torch.bfloat16)
        sync()
        seconds = time.perf_counter() - started
    finally:
        weight_stream.MAX_READERS = default
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"readers": readers, "load_s": round(seconds, 3), "gb_per_s": round(nbytes / seconds / 1e9, 2)}


def verify(model_dir: Path, device: str) -> int:
    """Load through the engine's loader and compare every parameter slice with safetensors' own
    reading of the same tensor: the number of tensors checked (raises on the first mismatch)."""
    import torch
    from safetensors import safe_open

    from gpuworker.models.loader import checkpoint_targets, load_model

    model = load_model(model_dir, device=device, dtype=torch.bfloat16)
    targets, checked = checkpoint_targets(model), 0
    for file in checkpoint_files(model_dir):
        with safe_open(file, framework="pt", device=device) as f:
            for name in f.keys():
                t = targets[name]
                if not torch.equal(t.param[t.start : t.start + t.rows], f.get_tensor(name)):
                    raise AssertionError(f"{name} differs from {file.name}")
                checked += 1
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return checked


HF_SNIPPET = """
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device_map="cuda")
torch.cuda.synchronize()
print(json.dumps({"imports_s": round(t1 - t0, 3), "from_pretrained_s": round(time.perf_counter() - t1, 3)}))
"""


def hf_once(model: Path) -> dict:
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", HF_SNIPPET, str(model)], capture_output=True, text=True, timeout=READY_DEADLINE_S
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {
        "process_total_s": round(time.perf_counter() - started, 3),
        **json.loads(out.stdout.strip().splitlines()[-1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where the random checkpoint is (written once)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--cold", action="store_true", help="also run with the page cache dropped")
    parser.add_argument("--hf", action="store_true", help="also time transformers' from_pretrained")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout to time alike")
    parser.add_argument(
        "--spare-runs", type=int, default=0, help="warm runs through a spare (and one cold, with --cold)"
    )
    parser.add_argument("--readers", default="", help="comma-separated reader counts to time the loader alone with")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log, results_file = args.out / "load_time_replicas.log", args.out / "load_time.json"
    results: dict = {"environment": environment(), "runs": []}

    def record(label: str, result: dict) -> None:
        results["runs"].append({"label": label, **result})
        results_file.write_text(json.dumps(results, indent=2))
        print(label, json.dumps(result), flush=True)

    started = time.perf_counter()
    write_checkpoint(args.dir, args.config, args.shards)
    files = checkpoint_files(args.dir)
    total_bytes = sum(f.stat().st_size for f in files)
    results["checkpoint"] = {
        "bytes": total_bytes,
        "files": len(files),
        "write_s": round(time.perf_counter() - started, 1),
    }
    record("loader check", {"tensors_equal": verify(args.dir, args.device)})
    for readers in (int(r) for r in args.readers.split(",") if r):
        record(f"loader alone, {readers} readers, warm", loader_alone(args.dir, args.device, readers))
    trees = [("new", ROOT)] + ([("baseline", args.baseline_tree.resolve())] if args.baseline_tree else [])
    serve_once(ROOT, args.dir, args.device, log)  # untimed: Triton's cache, and the page cache
    for name, tree in trees:
        for i in range(args.warm_runs):
            record(f"{name} warm #{i + 1}", serve_once(tree, args.dir, args.device, log))
    for i in range(args.spare_runs):
        record(f"spare warm #{i + 1}", spare_once(args.dir, args.device, Path(tempfile.mkdtemp(prefix="spare-"))))
    if args.hf:
        record("hf from_pretrained warm", hf_once(args.dir))
    if args.cold:
        drop_cache(args.dir)
        seconds, nbytes = sequential_read(args.dir)
        record("disk sequential read cold", {"read_s": round(seconds, 3), "gb_per_s": round(nbytes / seconds / 1e9, 3)})
        for name, tree in trees:
            drop_cache(args.dir)
            record(f"{name} cold", serve_once(tree, args.dir, args.device, log))
        if args.spare_runs:
            drop_cache(args.dir)
            record("spare cold", spare_once(args.dir, args.device, Path(tempfile.mkdtemp(prefix="spare-"))))
    rows = [(run["label"], "  ".join(f"{k}={v}" for k, v in run.items() if k != "label")) for run in results["runs"]]
    print_table(f"load time, {total_bytes / 1e9:.1f} GB in {len(files)} files ({results['environment']})", rows)


if __name__ == "__main__":
    main()
