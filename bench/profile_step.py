"""Where a step's time goes: host phases of LLMEngine.step against the GPU time of the same work.

    python bench/profile_step.py [--batch-sizes 1,64,256] [--steps 50]

For each decode batch size it times, on the host, the scheduler, input preparation, the launch
of the forward (graph replay), logits + sampling up to the one device->host transfer, and the
post-processing (stop checks, detokenization, outputs); and, with CUDA events, the GPU time of
the forward and of logits + sampling alone. Host time not hidden behind GPU time is overhead.
"""

from __future__ import annotations

import pathlib
import random
import time
from collections import defaultdict

import torch

from common import engine_parser, environment, load_hf_config, print_table, write_json


class PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[label] += time.perf_counter() - t0

        setattr(obj, name, timed)


def profile_decode(args, batch_size: int) -> dict:
    from gpuworker.engine import LLMEngine, SamplingParams

    cfg = load_hf_config(args.config)
    engine = LLMEngine(
        str(args.config),
        device="cuda",
        dtype=args.dtype,
        load_format="dummy",
        max_num_seqs=max(batch_size, 8),
        max_num_batched_tokens=max(8192, batch_size),
        max_model_len=args.max_model_len,
        seed=0,
    )
    rng = random.Random(0)
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_model_len - max(args.prompt_len, args.prefill_len) - 1, ignore_eos=True
    )
    for i in range(batch_size):
        engine.add_request(f"p{i}", [rng.randrange(cfg["vocab_size"]) for _ in range(args.prompt_len)], params)
    # Prefill everything and warm up until every step is a pure decode of the whole batch.
    for _ in range(args.warmup):
        engine.step()
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    runner = engine.runner
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "postprocess", "scheduler.postprocess")
    timer.wrap(runner, "host_inputs", "host inputs")
    timer.wrap(runner, "forward", "forward launch (inputs' copy + replay)")
    timer.wrap(runner, "launch", "launch (prepare + forward + sample)")
    timer.wrap(runner, "wait", "wait for sampled ids")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    loop_ops = loop_table(engine, args.steps) if args.kernels else []
    timeline = timeline_table(engine, args.steps) if args.timeline else {}

    # GPU time of the same forward and of logits + greedy sampling, back to back on the device.
    if args.prefill_len:
        # A mixed step, as when a new request joins a running batch: its whole prompt (eager).
        engine.add_request("joining", [rng.randrange(cfg["vocab_size"]) for _ in range(args.prefill_len)], params)
    batch = engine.scheduler.schedule()
    shape = f"{batch.num_decode_seqs} decodes + {batch.num_batched_tokens - batch.num_decode_seqs} prefill tokens"
    context = sum(e.start + e.num_new_tokens for e in batch.seqs) / max(1, len(batch.seqs))
    # With async scheduling this batch's inputs read the in-flight step's sampled ids.
    inflight = engine._inflight.handle if engine._inflight is not None else None
    host = runner.host_inputs(batch)
    inputs = runner.prepare_inputs(batch, inflight, host=host)
    start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.inference_mode():
        for _ in range(3):
            rows = runner.forward(host, batch, inflight)
        torch.cuda.synchronize()
        start.record()
        for _ in range(args.steps):
            rows = runner.forward(host, batch, inflight)  # inputs' copy + graph replay, or eager
        mid.record()
        for _ in range(args.steps):
            # What the runner does for a greedy batch: the argmax inside the lm_head launch.
            runner.model.greedy_tokens(rows)
        end.record()
        end.synchronize()
    forward_gpu = start.elapsed_time(mid) / 1e3 / args.steps
    kernels = kernel_table(runner, inputs, args.steps) if args.kernels else []
    logits_gpu = mid.elapsed_time(end) / 1e3 / args.steps
    per_step = {label: total / args.steps for label, total in timer.totals.items()}
    del engine, runner
    torch.cuda.empty_cache()
    return {
        "batch_size": batch_size,
        "measured_batch": shape,
        "mean_context": context,
        "step_wall_s": wall,
        "forward_gpu_s": forward_gpu,
        "logits_sample_gpu_s": logits_gpu,
        "host_phases_s": per_step,
        "kernels": kernels,
        "loop_ops": loop_ops,
        "timeline": timeline,
    }


def loop_table(engine, steps: int) -> list[tuple[str, float, float, int]]:
    """The engine loop under the profiler: per step, each op's host self time and device time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = [
        (e.key[:60], e.self_cpu_time_total / 1e3 / steps, e.self_device_time_total / 1e3 / steps, e.count // steps)
        for e in prof.key_averages()
    ]
    device_total = sum(r[2] for r in rows)
    rows = sorted(rows, key=lambda r: -r[1])[:18]
    return [("ALL device time per step", 0.0, device_total, 0)] + rows


def timeline_table(engine, steps: int) -> dict:
    """The device timeline of the engine loop: kernel time vs idle time between kernels, per step.

    Kernels from the profiler's trace (those inside CUDA graph replays included), in start order.
    busy = the union of kernel intervals, idle = the rest of the span; the pairs table says after
    which kernel and before which the idle time falls (mean microseconds per occurrence). With
    programmatic dependent launch a kernel starts before the previous one ends and waits, so its
    own duration includes that wait; the union is what counts.
    """
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(pathlib.Path(f.name).read_text())["traceEvents"]
    kernels = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:48]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    if not kernels:
        return {}
    busy = idle = 0.0
    end = kernels[0][0]
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    previous = None
    for start, stop, name in kernels:
        gap = max(0.0, start - end)
        idle += gap
        busy += max(0.0, stop - max(start, end))
        if previous is not None:
            pairs[(previous, name)].append(gap)
        end = max(end, stop)
        previous = name
    top = sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {
        "kernels_per_step": len(kernels) / steps,
        "busy_us_per_step": busy / steps,
        "idle_us_per_step": idle / steps,
        "idle_pairs": [(f"{a} -> {b}", sum(g) / steps, sum(g) / len(g), len(g) // steps) for (a, b), g in top],
    }


def kernel_table(runner, inputs, steps: int) -> list[tuple[str, float, int]]:
    """GPU time per forward of each kernel (eager forward, same shapes), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        torch.cuda.synchronize()
    rows = [
        (e.key[:60], e.device_time_total / 1e3 / steps, e.count // steps)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r[1])[:16]


def main() -> None:
    parser = engine_parser(__doc__, device=None)  # CUDA events and graphs: CUDA only
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--prefill-len",
        type=int,
        default=0,
        help="GPU-time a mixed step: the decode batch plus one new prompt of this length",
    )
    parser.add_argument("--kernels", action="store_true", help="also print a per-kernel GPU time table")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also print the engine loop's device timeline: kernel vs idle time between kernels",
    )
    args = parser.parse_args()

    results = [profile_decode(args, int(b)) for b in args.batch_sizes.split(",")]
    for r in results:
        ms = lambda s: f"{1e3 * s:.3f} ms"  # noqa: E731
        gpu = r["forward_gpu_s"] + r["logits_sample_gpu_s"]
        rows = [
            ("GPU-timed batch", f"{r['measured_batch']}, mean context {r['mean_context']:.0f}"),
            ("step wall time (pure decode)", ms(r["step_wall_s"])),
            ("GPU: forward", ms(r["forward_gpu_s"])),
            ("GPU: logits + argmax", ms(r["logits_sample_gpu_s"])),
            ("not GPU-bound (wall - GPU)", ms(r["step_wall_s"] - gpu)),
        ]
        rows += [(f"host: {label}", ms(value)) for label, value in r["host_phases_s"].items()]
        print_table(f"decode step, batch {r['batch_size']}", rows)
        if r["loop_ops"]:
            print_table(
                f"engine loop ops per step (host self ms / device ms), batch {r['batch_size']}",
                [(name, f"{cpu:.3f} / {dev:.3f} x{count}") for name, cpu, dev, count in r["loop_ops"]],
            )
        if r["timeline"]:
            t = r["timeline"]
            rows = [
                ("kernels per step", f"{t['kernels_per_step']:.0f}"),
                ("device busy per step", f"{t['busy_us_per_step']:.1f} us"),
                ("device idle per step", f"{t['idle_us_per_step']:.1f} us"),
            ]
            rows += [
                (pair, f"{total:.1f} us/step ({mean:.2f} us x{count})") for pair, total, mean, count in t["idle_pairs"]
            ]
            print_table(f"device timeline of the engine loop, batch {r['batch_size']}", rows)
        if r["kernels"]:
            print_table(
                f"kernels per eager forward, batch {r['batch_size']}",
                [(name, f"{ms_:.3f} ms x{count}") for name, ms_, count in r["kernels"]],
            )
    write_json(
        "profile_step", {"env": environment(), "args": vars(args) | {"config": str(args.config)}, "results": results}
    )


if __name__ == "__main__":
    main()
