"""The engine process's serving overhead (issue 21): steps/s of N concurrent streams through
start_engine(process=True) against offline LLMEngine on the same requests, without HTTP.

    python bench/engine_overhead.py                            # CPU: a tiny random llama, 512 streams
    python bench/engine_overhead.py --device cuda --checkpoint /root/ckpt-serving   # the H200
    python bench/engine_overhead.py --profile                  # + where each process spends its time
    python bench/engine_overhead.py --chunk-cost-us 400        # an API process slower than the steps

Workload (seed 0): --streams requests sent at once, prompts of U[--prompt-len] random token ids,
outputs of U[--output-len] tokens (greedy, ignore_eos). Rows, each in a process of its own:
  offline generate   LLMEngine.generate (final_only: no per-step outputs), as bench/serving.py's baseline
  offline streaming  LLMEngine.add_request + step() in a loop: cumulative outputs every step, no process
  engine process     start_engine(process=True), one asyncio consumer per stream turning each
                     output into an SSE-like JSON chunk (what the replica does, less the HTTP;
                     --chunk-cost-us spins that long per chunk besides, GIL held, as HTTP would),
                     asking for delta outputs as the replica does
  process-cumulative the same with cumulative outputs (the replica before it asked for deltas: the
                     API process copied each stream's answer so far every step)
ms/step = wall time / engine steps (for the engine process, its shared step counter); the engine
process row also gives the messages the API side received (fewer than steps: merged), its
reader thread's time per step, and both processes' CPU time per step. --profile adds a second,
profiled run of the engine process row (not timed): cProfile's top functions of the engine
process's loop thread, the API process's event loop and its reader thread (from Python 3.12 one
profile per process, all its threads together).

--checkpoint: a Hugging Face directory (on the GPU, bench/serving.py's random Llama-3-8B, written
there from --config when not complete); without it, a tiny random llama built as the tests build it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import multiprocessing
import os
import pstats
import random
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import DEFAULT_CONFIG, environment, print_table, write_checkpoint, write_json  # noqa: E402

PROFILE_TOP = 18
SERVING_PATH = r"engine_process|output_streams|connection|reduction|llm_engine.py.*_output"


def workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    lo_p, hi_p = args.prompt_len
    lo_o, hi_o = args.output_len
    return [
        ([rng.randrange(3, vocab_size) for _ in range(rng.randint(lo_p, hi_p))], rng.randint(lo_o, hi_o))
        for _ in range(args.streams)
    ]


def engine_config(args: argparse.Namespace) -> dict:
    config = {
        "device": args.device,
        "dtype": args.dtype,
        "max_num_seqs": args.streams,
        "max_model_len": args.prompt_len[1] + args.output_len[1] + 16,
    }
    if args.device == "cpu":
        config["num_kv_blocks"] = args.streams * (config["max_model_len"] // 16 + 1)
    return config


def _params(max_tokens: int, output_kind: str = "cumulative"):
    from gpuworker.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, output_kind=output_kind)


def _warm_up_requests(requests):
    return [(prompt, min(8, max_tokens)) for prompt, max_tokens in requests[:32]]


# -- offline rows (each in a process of its own: one engine on the device at a time) ------------


def run_offline(model: str, config: dict, requests: list, streaming: bool) -> dict:
    from gpuworker.engine import LLMEngine

    engine = LLMEngine(model, **config)
    try:
        for i, (prompt, max_tokens) in enumerate(_warm_up_requests(requests)):
            engine.add_request(f"warm-{i}", prompt, _params(max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        timing = _time_steps(engine)
        tokens = 0
        start = time.perf_counter()
        cpu_start = time.process_time()
        if streaming:
            for i, (prompt, max_tokens) in enumerate(requests):
                engine.add_request(f"r{i}", prompt, _params(max_tokens))
            while engine.has_unfinished_requests():
                tokens += sum(len(c.delta_token_ids) for out in engine.step() for c in out.outputs)
        else:
            outputs = engine.generate([prompt for prompt, _ in requests], [_params(n) for _, n in requests])
            tokens = sum(out.num_generated_tokens for out in outputs)
        wall = time.perf_counter() - start
        return {
            "steps": timing["steps"],
            "wall_s": wall,
            "tokens": tokens,
            "cpu_s": time.process_time() - cpu_start,
            "step_s": timing["s"],
        }
    finally:
        engine.shutdown()


def _time_steps(llm) -> dict:
    """Count LLMEngine.step's calls and the time inside them (the engine loops step through the
    instance attribute); the rest of a loop's time per step is its overhead."""
    timing = {"steps": 0, "s": 0.0}
    step = llm.step

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            timing["s"] += time.perf_counter() - start
            timing["steps"] += 1

    llm.step = timed_step
    return timing


# -- the engine process row ---------------------------------------------------------------------


def _engine_figures(llm) -> tuple[float, float]:
    """In the engine process: CPU time of all its threads, and time inside LLMEngine.step so far."""
    if "bench_timing" not in llm.__dict__:
        llm.__dict__["bench_timing"] = _time_steps(llm)
    return time.process_time(), llm.__dict__["bench_timing"]["s"]


# Before Python 3.12 a cProfile.Profile follows the thread that enabled it (the reader thread needs
# its own); from 3.12 it follows every thread (sys.monitoring), and only one may be enabled at once.
PER_THREAD_PROFILES = sys.version_info < (3, 12)


def _start_profile(llm) -> None:  # in the engine process, on its loop thread (calls run there)
    profile = cProfile.Profile()
    llm.__dict__["bench_profile"] = profile
    profile.enable()


def _stop_profile(llm) -> str:
    profile = llm.__dict__.pop("bench_profile")
    profile.disable()
    return _top(profile)


def _top(profile: cProfile.Profile) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(PROFILE_TOP)
    stats.sort_stats("cumulative").print_stats(PROFILE_TOP)
    # The serving path itself, however small next to the model: the loop, the wire, the pipe.
    stats.sort_stats("cumulative").print_stats(SERVING_PATH, PROFILE_TOP)
    return out.getvalue()


async def _consume(
    engine, prompt, max_tokens, request_id, chunk_cost_s: float = 0.0, output_kind: str = "delta"
) -> int:
    """One stream as the replica consumes it: each output becomes a JSON chunk, and takes
    chunk_cost_s of this process's Python besides (the replica's HTTP and SSE work, GIL held)."""
    tokens = 0
    async for output in engine.generate(prompt, _params(max_tokens, output_kind), request_id):
        for c in output.outputs:
            tokens += len(c.delta_token_ids)
            json.dumps(
                {
                    "id": request_id,
                    "choices": [{"index": c.index, "text": c.delta_text, "finish_reason": c.finish_reason}],
                }
            )
        end = time.perf_counter() + chunk_cost_s
        while time.perf_counter() < end:
            pass
    return tokens


async def _engine_process(
    model: str, config: dict, requests: list, profile: bool, chunk_cost_s: float, output_kind: str
) -> dict:
    from gpuworker.engine import start_engine

    engine = start_engine(model, process=True, **config)
    try:
        await asyncio.gather(
            *(_consume(engine, prompt, n, f"warm-{i}") for i, (prompt, n) in enumerate(_warm_up_requests(requests)))
        )
        reader = {"s": 0.0, "messages": 0}
        on_outputs = engine._on_outputs
        reader_profile = cProfile.Profile() if profile and PER_THREAD_PROFILES else None

        def timed_on_outputs(*args):  # the reader thread's work per outputs message
            start = time.perf_counter()
            if reader_profile is not None:
                reader_profile.enable()  # cProfile follows the thread that enables it
            on_outputs(*args)
            if reader_profile is not None:
                reader_profile.disable()
            reader["s"] += time.perf_counter() - start
            reader["messages"] += 1

        engine._on_outputs = timed_on_outputs
        if profile:
            await engine.call(_start_profile)
            api_profile = cProfile.Profile()
            api_profile.enable()
        engine_cpu, step_s = await engine.call(_engine_figures)
        steps = engine.num_steps
        cpu_start = time.process_time()
        start = time.perf_counter()
        tokens = await asyncio.gather(
            *(_consume(engine, prompt, n, f"r{i}", chunk_cost_s, output_kind) for i, (prompt, n) in enumerate(requests))
        )
        wall = time.perf_counter() - start
        cpu_s = time.process_time() - cpu_start
        engine_cpu_end, step_end = await engine.call(_engine_figures)
        result = {
            "steps": engine.num_steps - steps,
            "wall_s": wall,
            "tokens": sum(tokens),
            "cpu_s": cpu_s,
            "engine_cpu_s": engine_cpu_end - engine_cpu,
            "step_s": step_end - step_s,
            "messages": reader["messages"],
            "reader_s": reader["s"],
        }
        if profile:
            api_profile.disable()
            result["engine_profile"] = await engine.call(_stop_profile)
            result["api_profile"] = _top(api_profile)
            if reader_profile is not None:
                result["api_reader_profile"] = _top(reader_profile)
        return result
    finally:
        await asyncio.to_thread(engine.shutdown)


def run_engine_process(
    model: str, config: dict, requests: list, profile: bool, chunk_cost_s: float, output_kind: str = "delta"
) -> dict:
    return asyncio.run(_engine_process(model, config, requests, profile, chunk_cost_s, output_kind))


# -- the run ------------------------------------------------------------------------------------


def in_own_process(function, *args):
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def prepare_model(args: argparse.Namespace) -> Path:
    if args.checkpoint is not None:
        if args.device != "cpu":
            in_own_process(write_checkpoint, args.checkpoint, args.config, 4)
        return args.checkpoint
    from tests.gpuworker.checkpoints import make_checkpoint

    return make_checkpoint(Path(tempfile.mkdtemp(prefix="engine-overhead-")), "llama", max_position_embeddings=2048)


def pair(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the shape written to --checkpoint")
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--prompt-len", type=pair, default=None, help="lo,hi (default 16,64 CPU; 100,1024 CUDA)")
    parser.add_argument("--output-len", type=pair, default=None, help="lo,hi (default 32,128 CPU; 64,512 CUDA)")
    parser.add_argument("--rows", default="generate,streaming,process")
    parser.add_argument(
        "--chunk-cost-us",
        type=float,
        default=0.0,
        help="Python work per stream chunk in the API process (the replica's HTTP/SSE, "
        "GIL held): past a step's time per step, the API side is behind the engine",
    )
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.prompt_len = args.prompt_len or ((100, 1024) if cuda else (16, 64))
    args.output_len = args.output_len or ((64, 512) if cuda else (32, 128))
    if not cuda:
        # Two processes share the CPU here (the engine's and the API's): one thread each for torch.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = prepare_model(args)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    requests = workload(args, vocab_size)
    config = engine_config(args)
    results = {}
    for row in args.rows.split(","):
        if row.startswith("process"):
            chunk_cost_s = args.chunk_cost_us * 1e-6
            kind = "cumulative" if row == "process-cumulative" else "delta"
            results[row] = in_own_process(run_engine_process, str(model), config, requests, False, chunk_cost_s, kind)
            if args.profile:  # a run of its own: cProfile slows the Python it watches, steps included
                profiled = in_own_process(run_engine_process, str(model), config, requests, True, chunk_cost_s, kind)
                results[row] |= {key: value for key, value in profiled.items() if key.endswith("profile")}
        else:
            results[row] = in_own_process(run_offline, str(model), config, requests, row == "streaming")
    table = []
    base = results.get("generate")
    for row, r in results.items():
        ms = 1000 * r["wall_s"] / max(r["steps"], 1)
        in_step = 1000 * r["step_s"] / max(r["steps"], 1)
        line = (
            f"{r['steps']:5d} steps  {ms:7.2f} ms/step = step {in_step:7.2f} + outside {ms - in_step:6.2f}"
            f"  {r['tokens'] / r['wall_s']:9.1f} tok/s"
        )
        if base is not None:
            line += f"  {r['tokens'] / r['wall_s'] / (base['tokens'] / base['wall_s']):.3f}x generate"
        table.append((row, line))
        if row.startswith("process"):
            table.append(("  engine process", f"cpu {1000 * r['engine_cpu_s'] / max(r['steps'], 1):.2f} ms/step"))
            table.append(("  API process", f"cpu {1000 * r['cpu_s'] / max(r['steps'], 1):.2f} ms/step"))
            table.append(
                (
                    "  API reader",
                    f"{r['messages']} outputs messages, {1000 * r['reader_s'] / max(r['steps'], 1):.2f} ms/step",
                )
            )
    env = environment()
    print_table(
        f"engine overhead: {args.streams} streams, {args.device} {args.dtype}, commit {env.get('commit')}", table
    )
    for row, r in results.items():
        for key in ("engine_profile", "api_profile", "api_reader_profile"):
            if key in r:
                print(f"\n== {row}: {key} ==\n{r.pop(key)}")
    write_json(
        "engine_overhead", {"args": {k: str(v) for k, v in vars(args).items()}, "environment": env, "results": results}
    )


if __name__ == "__main__":
    main()
