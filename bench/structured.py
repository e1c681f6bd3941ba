"""Constrained decoding throughput: the same requests with and without a JSON schema.

    python bench/structured.py [--num-requests 256] [--max-tokens 256]   # Llama-3-8B shape, GPU
    python bench/structured.py --tiny                                     # 2 tiny layers, CPU

Workload (seed 0): --num-requests random-token prompts, all submitted at once. Run 1 constrains each
to an order-like JSON schema (nested object, array of objects, enums, bounded numbers and strings);
run 2 sends the same prompts unconstrained with ignore_eos and max_tokens set to exactly the length
run 1 produced for that request, so both runs decode identical token counts through identical batch
shapes. The figure of merit is constrained / unconstrained output tok/s (target >= 0.9 on the GPU).

Grammars need a real tokenizer over the model's vocabulary. Without one in --config, a byte-level
BPE of the model's vocab size is trained on the Python standard library's source (deterministic,
offline; about a minute for 128k tokens) and cached in --tokenizer-dir. Its tokens are code-like
(braces, quotes, indentation runs), so the grammar's per-step mask work is in the range of a real
Llama-3 vocabulary, not that of a byte-level toy.
"""

from __future__ import annotations

import glob
import json
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from common import (
    BENCH_DIR,
    Timer,
    add_engine_options,
    engine_parser,
    environment,
    load_hf_config,
    print_table,
    write_json,
)
from throughput import make_workload

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "vip": {"type": "boolean"},
            },
            "required": ["name", "email", "vip"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number"},
                },
                "required": ["sku", "quantity", "unit_price"],
            },
            "minItems": 1,
            "maxItems": 5,
        },
        "notes": {"type": "string", "maxLength": 80},
    },
    "required": ["order_id", "status", "customer", "items"],
}
# Llama-3's special tokens sit after its 128000 BPE tokens; the benchmark config's BOS/EOS ids are theirs.
SPECIAL_TOKENS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"}


def build_bpe_tokenizer(directory: Path, vocab_size: int, num_special: int = 256) -> Path:
    """Train a byte-level BPE with vocab_size - num_special merges on the stdlib source, then add
    num_special special tokens (Llama-3's names where the ids match), and save it to directory."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if (directory / "tokenizer.json").is_file():
        return directory
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    num_bpe = vocab_size - num_special
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    started = time.perf_counter()
    tokenizer.train_from_iterator((Path(f).read_text(encoding="utf-8", errors="ignore") for f in files), trainer)
    if tokenizer.get_vocab_size() != num_bpe:
        raise RuntimeError(f"the stdlib source gave {tokenizer.get_vocab_size()} BPE tokens, not {num_bpe}")
    names = [SPECIAL_TOKENS.get(num_bpe + i, f"<|reserved_special_token_{i}|>") for i in range(num_special)]
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": names[0],
                "eos_token": names[min(9, num_special - 1)],
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    print(f"trained a {vocab_size}-token BPE on {len(files)} stdlib files in {time.perf_counter() - started:.0f} s")
    return directory


def model_directory(args, workdir: Path) -> Path:
    """--config's model (dummy weights) or, with --tiny, a 2-layer random model of its vocabulary,
    next to --config's tokenizer or the trained BPE."""
    config = Path(args.config)
    hf_config = load_hf_config(config)
    if (config / "tokenizer.json").is_file():
        tokenizer = config
    else:
        tokenizer = build_bpe_tokenizer(tokenizer_dir(args, hf_config["vocab_size"]), hf_config["vocab_size"])
    directory = workdir / "model"
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(args.seed)
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=hf_config["vocab_size"],
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=2048,
                bos_token_id=hf_config["bos_token_id"],
                eos_token_id=hf_config["eos_token_id"],
                architectures=["LlamaForCausalLM"],
            )
        ).save_pretrained(str(directory))
    else:
        directory.mkdir()
        shutil.copy(config / "config.json", directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, directory)
    return directory


def tokenizer_dir(args, vocab_size: int) -> Path:
    return Path(args.tokenizer_dir or BENCH_DIR / "results" / f"bpe-{vocab_size}")


class MaskTimer:
    """Accumulates the host time of the engine's per-step grammar work (instrumentation only)."""

    def __init__(self, grammar_matchers) -> None:
        self.seconds = {"bitmask": 0.0, "accept": 0.0}
        self.calls = {"bitmask": 0, "accept": 0}
        self.rows = 0
        for name in self.seconds:
            self._wrap(grammar_matchers, name)

    def _wrap(self, target, name: str) -> None:
        original = getattr(target, name)

        def timed(*args):
            started = time.perf_counter()
            result = original(*args)
            self.seconds[name] += time.perf_counter() - started
            self.calls[name] += 1
            if name == "bitmask" and result is not None:
                self.rows += len(result.rows)
            return result

        setattr(target, name, timed)

    def summary(self) -> dict:
        steps = max(self.calls["bitmask"], 1)
        return {
            "mask_ms_per_step": 1e3 * self.seconds["bitmask"] / steps,
            "mask_us_per_row": 1e6 * self.seconds["bitmask"] / max(self.rows, 1),
            "accept_us_per_token": 1e6 * self.seconds["accept"] / max(self.calls["accept"], 1),
            "constrained_rows_per_step": self.rows / steps,
            "steps": self.calls["bitmask"],
        }


def run(engine, prompts, params_list) -> dict:
    with Timer(str(engine.device)) as t:
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            engine.add_request(f"req-{i}", prompt, params)
        outputs = {}
        step_ms = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            step_ms.append(1e3 * (time.perf_counter() - started))
    ordered = [outputs[f"req-{i}"] for i in range(len(prompts))]
    generated = sum(len(out.token_ids) for out in ordered)
    ranked = sorted(step_ms)
    return {
        "seconds": t.elapsed,
        "output_tokens": generated,
        "output_tok_s": generated / t.elapsed,
        "outputs": ordered,
        "steps": len(step_ms),
        "step_ms_p50": ranked[len(ranked) // 2],
        "step_ms_p90": ranked[int(len(ranked) * 0.9)],
        "slowest_steps_ms": sorted(((round(ms, 1), i) for i, ms in enumerate(step_ms)), reverse=True)[:8],
    }


def profile_steps(engine, prompts, params_list, *, skip: int = 16, steps: int = 24) -> dict:
    """Where a step's time goes once every request decodes: host phases (wall, per step), then the
    same steps under torch.profiler (top ops by host and by device time). Aborts the requests after."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"prof-{i}", prompt, params)
    for _ in range(skip):
        engine.step()
    totals: dict[str, float] = defaultdict(float)
    originals = []

    def wrap(obj, name: str) -> None:
        inner = getattr(obj, name)
        originals.append((obj, name, inner))

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                totals[name] += time.perf_counter() - t0

        setattr(obj, name, timed)

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    wrap(engine.scheduler, "schedule")
    wrap(engine.runner, "launch")
    wrap(engine.runner, "sample")
    wrap(engine.runner, "wait")
    wrap(engine, "_receive")
    wrap(engine, "_process")
    if engine.grammar_matchers is not None:
        wrap(engine.grammar_matchers, "bitmask")
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    wall = (time.perf_counter() - t0) / steps
    for obj, name, inner in originals:
        setattr(obj, name, inner)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        sync()
    averages = prof.key_averages()
    by_host = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:14]
    by_device = sorted(averages, key=lambda e: -e.self_device_time_total)[:10]
    for request_id in engine.unfinished_request_ids():
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "step_ms": 1e3 * wall,
        "phases_ms": {k: 1e3 * v / steps for k, v in totals.items()},
        "top_host_ops_ms": [(e.key[:50], e.self_cpu_time_total / 8e3, e.count // 8) for e in by_host],
        "top_device_ops_ms": [(e.key[:50], e.self_device_time_total / 8e3, e.count // 8) for e in by_device],
    }


def check_outputs(outputs) -> dict:
    """How many constrained outputs completed, and whether every completed one is schema-shaped."""
    completed = [out for out in outputs if out.finish_reason == "stop"]
    for out in completed:
        value = json.loads(out.text)
        missing = [key for key in ORDER_SCHEMA["required"] if key not in value]
        if missing or value["status"] not in ORDER_SCHEMA["properties"]["status"]["enum"]:
            raise RuntimeError(f"a completed output does not follow the schema: {out.text!r}")
    return {"completed": len(completed), "cut_by_max_tokens": len(outputs) - len(completed)}


def main() -> None:
    parser = engine_parser(
        __doc__,
        dtype=None,
        dtype_help="default: bfloat16 on CUDA, float32 on CPU",
        device="cuda" if torch.cuda.is_available() else "cpu",
        raw_description=True,
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a 2-layer random model with --config's vocabulary (a CPU check of the whole path)",
    )
    parser.add_argument("--num-requests", type=int, default=None, help="default: 256 (GPU), 16 (--tiny)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    add_engine_options(parser, max_num_seqs=256, max_model_len=1024)
    parser.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--tokenizer-dir",
        default=None,
        help="where the trained BPE tokenizer is cached (default bench/results/bpe-<vocab>)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison, print per-step phases and top ops of both kinds of batch",
    )
    parser.add_argument(
        "--build-tokenizer-only",
        action="store_true",
        help="train and cache the tokenizer for --config, then exit (run it off the GPU)",
    )
    args = parser.parse_args()
    if args.build_tokenizer_only:
        vocab_size = load_hf_config(Path(args.config))["vocab_size"]
        build_bpe_tokenizer(tokenizer_dir(args, vocab_size), vocab_size)
        return
    num_requests = args.num_requests or (16 if args.tiny else 256)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    from gpuworker.engine import LLMEngine, SamplingParams
    from gpuworker.engine.structured_output import StructuredOutput

    with tempfile.TemporaryDirectory() as workdir:
        model = model_directory(args, Path(workdir))
        vocab_size = load_hf_config(model)["vocab_size"]
        engine = LLMEngine(
            str(model),
            device=args.device,
            dtype=dtype,
            load_format="auto" if args.tiny else "dummy",
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,  # random prompts share nothing
            async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        )
    prompts = [
        prompt
        for prompt, _ in make_workload(
            num_requests, min(vocab_size, 32000), args.seed, args.min_prompt_len, args.max_prompt_len
        )
    ]
    schema = StructuredOutput.json_schema(ORDER_SCHEMA)

    # Warm-up: kernels, graph capture, the mask kernel, and the schema's compile (timed on its own).
    t0 = time.perf_counter()
    engine.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    compile_started = time.perf_counter()
    engine.add_request("compile", prompts[0], SamplingParams(max_tokens=8, structured_output=schema))
    compile_s = time.perf_counter() - compile_started
    while engine.has_unfinished_requests():
        engine.step()
    # The mask kernel is JIT-compiled per kind of row count (1, a multiple of 16, other), and CUDA
    # graphs are captured per batch size as the batch first shrinks through it: once per process,
    # so warmed up here (one untimed pass of the workload) rather than charged to the first run.
    for count in (16, 17):
        engine.generate(prompts[:count], SamplingParams(max_tokens=4, structured_output=schema))
    engine.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True))
    warmup_s = time.perf_counter() - t0

    if args.profile:
        for label, params in (
            (
                "json_schema",
                SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, structured_output=schema),
            ),
            (
                "unconstrained",
                SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True),
            ),
        ):
            report = profile_steps(engine, prompts, [params] * num_requests)
            print(f"\n== profile: {label}, step {report['step_ms']:.2f} ms ==")
            for name, ms in report["phases_ms"].items():
                print(f"  {name:<12}{ms:8.2f} ms/step")
            print("  top host ops (self, ms/step, calls/step):")
            for name, ms, count in report["top_host_ops_ms"]:
                print(f"    {name:<50}{ms:8.3f}{count:6d}")
            print("  top device ops:")
            for name, ms, count in report["top_device_ops_ms"]:
                print(f"    {name:<50}{ms:8.3f}{count:6d}")
        return

    timer = MaskTimer(engine.grammar_matchers)
    constrained = run(
        engine,
        prompts,
        [
            SamplingParams(
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                output_kind="final_only",
                structured_output=schema,
            )
            for i in range(num_requests)
        ],
    )
    masks = timer.summary()
    validity = check_outputs(constrained["outputs"])
    lengths = [len(out.token_ids) for out in constrained["outputs"]]
    free = run(
        engine,
        prompts,
        [
            SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, output_kind="final_only")
            for i, n in enumerate(lengths)
        ],
    )
    if free["output_tokens"] != constrained["output_tokens"]:
        raise RuntimeError(f"the runs differ in work: {free['output_tokens']} vs {constrained['output_tokens']} tokens")
    ratio = constrained["output_tok_s"] / free["output_tok_s"]

    workload = (
        f"{num_requests} requests, prompts {args.min_prompt_len}-{args.max_prompt_len} random tokens, "
        f"up to {args.max_tokens} output tokens (mean {sum(lengths) / len(lengths):.0f}), "
        f"temperature {args.temperature}, seed {args.seed}, {dtype} on {args.device}"
    )
    print_table(
        "structured output throughput",
        [
            (
                "model",
                f"{Path(args.config).name}"
                + (" vocabulary, 2 tiny layers" if args.tiny else ", dummy weights")
                + f", {vocab_size}-token tokenizer",
            ),
            ("workload", workload),
            ("unconstrained", f"{free['output_tok_s']:.0f} output tok/s ({free['seconds']:.2f} s)"),
            (
                "json_schema",
                f"{constrained['output_tok_s']:.0f} output tok/s ({constrained['seconds']:.2f} s); "
                f"{validity['completed']} completed, {validity['cut_by_max_tokens']} cut by max_tokens",
            ),
            ("ratio", f"{ratio:.3f} (target >= 0.9 on the GPU)"),
            (
                "steps",
                f"unconstrained {free['steps']} (p50 {free['step_ms_p50']:.1f} ms, p90 {free['step_ms_p90']:.1f}), "
                f"json_schema {constrained['steps']} (p50 {constrained['step_ms_p50']:.1f} ms, "
                f"p90 {constrained['step_ms_p90']:.1f})",
            ),
            (
                "slowest steps",
                f"unconstrained {free['slowest_steps_ms'][:4]}; json_schema {constrained['slowest_steps_ms']}",
            ),
            (
                "host mask work",
                f"{masks['mask_ms_per_step']:.2f} ms/step for {masks['constrained_rows_per_step']:.0f} "
                f"rows ({masks['mask_us_per_row']:.1f} us/row); accept "
                f"{masks['accept_us_per_token']:.1f} us/token",
            ),
            ("schema compile", f"{compile_s * 1e3:.0f} ms (first request; later ones hit the cache)"),
        ],
    )
    write_json(
        "structured",
        {
            "env": environment(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "unconstrained": {k: v for k, v in free.items() if k != "outputs"},
            "json_schema": {k: v for k, v in constrained.items() if k != "outputs"} | validity,
            "ratio": ratio,
            "host_mask": masks,
            "compile_s": compile_s,
            "warmup_s": warmup_s,
        },
    )


if __name__ == "__main__":
    main()
