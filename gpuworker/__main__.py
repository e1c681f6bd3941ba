"""Command line of the GPU worker.

python -m gpuworker serve --model PATH (--port 8100 | --fd N) [--device cpu|cuda] [--dtype auto]
                          [--max-num-seqs N] [--max-num-batched-tokens N] [--tensor-parallel-size N]
                          [--expert-parallel all_reduce|all_to_all]
                          [--engine-process | --engine-in-process]
python -m gpuworker daemon --control-url URL --token TOKEN [--name NAME] [--advertise-host H]
                           [--device auto|cpu|cuda] [--port-range LOW-HIGH] [--log-level info]
                           [--model-root DIR ...] [--stage-budget-bytes N] [--no-spare-replicas]
python -m gpuworker spare --device cpu|cuda:N --control-fd N  (started by the daemon; see replica/spare.py)
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from gpuworker.daemon.model_paths import MODEL_ROOTS_ENV
from gpuworker.daemon.staging import STAGE_BUDGET_ENV
from gpuworker.engine.config import EXPERT_PARALLEL_MODES
from gpuworker.replica.images import (
    DEFAULT_LOW_DETAIL_PIXELS,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
)

TOKEN_ENV = "GPUSERVE_WORKER_TOKEN"
HOST_KV_CACHE_ENV = "GPUSERVE_HOST_KV_CACHE_BYTES"


def _token_default() -> str | None:
    # GPUWORKER_TOKEN is the name `serve` read before the fleet-wide token existed.
    return os.environ.get(TOKEN_ENV) or os.environ.get("GPUWORKER_TOKEN")


def _port_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in text.split("-", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port-range must look like 8100-8199, got {text!r}") from None
    if not 1024 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"--port-range must be LOW-HIGH within 1024-65535, got {text!r}")
    return low, high


def _pem_file(text: str) -> str:
    """An existing file, as an absolute path (the daemon's replicas need not share its working
    directory): a missing CA bundle stops the command at once, not each replica at its start."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (give a PEM file of CA certificates)")
    return str(path.resolve())


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of bytes, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpuworker")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_daemon(commands)
    _add_spare(commands)
    return parser


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="serve one model over the OpenAI-compatible API")
    serve.add_argument("--model", required=True, help="directory of a Hugging Face checkpoint")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument(
        "--fd",
        type=int,
        default=None,
        metavar="FD",
        help="serve on this inherited socket, already bound (the daemon binds it so no other "
        "process can take the port first); --host and --port then only name it in logs",
    )
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument(
        "--token", default=_token_default(), help=f"require 'Authorization: Bearer TOKEN' (default: ${TOKEN_ENV})"
    )
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--allow-long-context",
        action="store_true",
        help="serve a --max-model-len past the model's max_position_embeddings (its quality there is untested)",
    )
    _add_image_fetch_arguments(serve)
    serve.add_argument(
        "--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES, help="images one chat request may carry"
    )
    serve.add_argument(
        "--max-image-bytes",
        type=int,
        default=DEFAULT_MAX_IMAGE_BYTES,
        help="largest image a request may carry, in bytes",
    )
    serve.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help="most pixels (width x height) an image may have; larger ones are refused from their header, "
        "before decoding",
    )
    serve.add_argument(
        "--low-detail-pixels",
        type=int,
        default=DEFAULT_LOW_DETAIL_PIXELS,
        help='most pixels an image part with "detail": "low" keeps: it is scaled down to them (aspect '
        'kept) before the model\'s processor, so it fills fewer tokens ("high" and "auto": the processor '
        "picks the resolution)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences in one step (default: as many as the GPU's KV cache holds at ~768 "
        "tokens each, up to 1024; 256 on CPU)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one step (default: from the model's size, 2048-16384; 8192 on CPU)",
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N ranks: GPUs device..device+N-1 (NCCL), or N CPU processes "
        "(gloo); the replica starts the N-1 worker processes itself",
    )
    serve.add_argument(
        "--expert-parallel",
        choices=EXPERT_PARALLEL_MODES,
        default="all_reduce",
        help="how a MoE model split over ranks joins its experts: all_reduce (every rank on every "
        "token, one all-reduce) or all_to_all (each rank's slice of the tokens dispatched to the "
        "experts' ranks and combined back)",
    )
    serve.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="quantize a float checkpoint's projections to FP8 at load (quantized FP8, AWQ and "
        "GPTQ checkpoints are detected from their config.json)",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="the KV cache's dtype: auto (the model's) or fp8 (e4m3 with per-layer scales, the "
        "checkpoint's k_scale/v_scale where it has them: twice the cached tokens; needs a GPU "
        "of compute capability 8.9+)",
    )
    serve.add_argument(
        "--host-kv-cache-bytes",
        type=_byte_count,
        default=0,
        help="host memory (pinned on CUDA) for a second KV tier: prefix-cache blocks evicted from "
        "the GPU are kept there and copied back when a later prompt shares their prefix "
        "(default 0: no host tier)",
    )
    serve.add_argument(
        "--scheduling",
        choices=("fair", "fcfs"),
        default="fair",
        help="the order waiting requests are admitted in: fair (interactive before batch, then the "
        "tenant with the least weighted service so far, as the gateway names them) or fcfs (arrival order)",
    )
    serve.add_argument(
        "--memory-fraction", type=float, default=0.9, help="fraction of free GPU memory the KV cache may take"
    )
    serve.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    serve.add_argument(
        "--engine-process",
        dest="engine_process",
        action="store_true",
        default=None,
        help="run the engine loop in a process of its own, so the server's HTTP work cannot slow "
        "its steps (the default on CUDA; on the CPU the engine steps in a thread)",
    )
    serve.add_argument(
        "--engine-in-process",
        dest="engine_process",
        action="store_false",
        help="run the engine loop in a thread of the server's process",
    )
    serve.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="stop (as on SIGTERM) when process PID, our parent, dies (Linux)",
    )
    serve.add_argument("--log-level", default="info")


def _add_image_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a vision model may fetch images from: a host's network policy, so both `serve` and
    `daemon` take these (the daemon passes them to every replica it starts, image_fetch_argv)."""
    parser.add_argument(
        "--allowed-image-domains",
        default="",
        metavar="DOMAINS",
        help="comma-separated domains (each with its subdomains) whose http(s) image URLs a vision "
        "model may fetch; none, the default: images only as data: URLs. Addresses that are not "
        "public (loopback, private, link-local, metadata) are refused whatever the domain",
    )
    parser.add_argument(
        "--image-ca-bundle",
        type=_pem_file,
        default=None,
        metavar="PEM",
        help="certificate authorities (a PEM file) that https image servers are checked against, "
        "e.g. an internal image store's own CA (default: the usual public ones, certifi's)",
    )


def image_fetch_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The daemon's image-fetch flags as the serve flags it passes on to each replica."""
    argv: tuple[str, ...] = ()
    if args.allowed_image_domains:
        argv += ("--allowed-image-domains", args.allowed_image_domains)
    if args.image_ca_bundle is not None:
        argv += ("--image-ca-bundle", args.image_ca_bundle)
    return argv


def _add_daemon(commands) -> None:
    daemon = commands.add_parser("daemon", help="the host agent: register, heartbeat, load/unload replicas")
    daemon.add_argument("--control-url", required=True, help="the control plane's base URL")
    daemon.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"the fleet's worker token (default: ${TOKEN_ENV})"
    )
    daemon.add_argument("--name", default=socket.gethostname(), help="this worker's name (default: host name)")
    daemon.add_argument(
        "--advertise-host",
        default=None,
        help="host the gateway reaches replicas at (default: the address facing the control plane)",
    )
    daemon.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    daemon.add_argument(
        "--port-range",
        type=_port_range,
        default=None,
        help="ports replicas may listen on, e.g. 8100-8199, for a firewall that opens only "
        "those (default: any free port, chosen by the OS)",
    )
    daemon.add_argument(
        "--state-dir", type=Path, default=None, help="where replica logs go (default: var/gpuworker/NAME)"
    )
    daemon.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish when the daemon is stopped",
    )
    daemon.add_argument(
        "--model-root",
        dest="model_roots",
        type=Path,
        action="append",
        default=None,
        help="a directory holding model checkpoints: the daemon loads models only from "
        "inside its model roots (paths resolved, so '..' and symlinks cannot leave "
        "them) and loads none without one; reported to the control plane so the "
        f"catalog can check weight paths (repeatable; default: ${MODEL_ROOTS_ENV}, "
        "separated by ':')",
    )
    daemon.add_argument(
        "--stage-budget-bytes",
        type=_byte_count,
        default=os.environ.get(STAGE_BUDGET_ENV, "0"),
        help="host memory (page cache) this worker may fill with the checkpoints the control "
        "plane expects to scale here, so such a load reads memory, not a cold disk "
        f"(default: ${STAGE_BUDGET_ENV}, else 0: no staging)",
    )
    daemon.add_argument(
        "--host-kv-cache-bytes",
        type=_byte_count,
        default=os.environ.get(HOST_KV_CACHE_ENV, "0"),
        help="host memory each replica of this worker keeps as a second KV tier (see serve "
        f"--host-kv-cache-bytes; default: ${HOST_KV_CACHE_ENV}, else 0: none)",
    )
    daemon.add_argument(
        "--spare-replicas",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep one replica process per GPU (or one on a CPU-only worker) started ahead, its "
        "imports done and its device initialised, so a load skips those seconds "
        "(default: on; --no-spare-replicas, or --no-spare, starts each replica afresh)",
    )
    daemon.add_argument("--no-spare", dest="spare_replicas", action="store_false", help=argparse.SUPPRESS)
    _add_image_fetch_arguments(daemon)
    daemon.add_argument("--log-level", default="info")


def _add_spare(commands) -> None:
    spare = commands.add_parser("spare", help="(started by the daemon) a replica process waiting for its load")
    spare.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: initialised before the load")
    spare.add_argument(
        "--control-fd",
        type=int,
        required=True,
        metavar="FD",
        help="inherited Unix socket the load's serve arguments and sockets arrive on",
    )
    spare.add_argument("--exit-with-parent", type=int, default=None, metavar="PID")
    spare.add_argument("--log-level", default="info")


def _configure_logging(level: str) -> None:
    # force: a spare configured logging before its load, whose level now applies.
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat and health poll otherwise


def wants_engine_process(args: argparse.Namespace) -> bool:
    """--engine-process / --engine-in-process, else a process of its own on CUDA only: on the CPU
    the model's own compute is the bottleneck, and tests start many replicas."""
    return args.engine_process if args.engine_process is not None else args.device.startswith("cuda")


def image_limits(args: argparse.Namespace) -> ImageLimits:
    """The replica's image limits from its serve flags (the daemon passes the catalog's)."""
    return ImageLimits(
        max_images=args.max_images_per_request,
        max_image_bytes=args.max_image_bytes,
        max_image_pixels=args.max_image_pixels,
        low_detail_pixels=args.low_detail_pixels,
        allowed_domains=tuple(domain for domain in args.allowed_image_domains.split(",") if domain.strip()),
        ca_bundle=args.image_ca_bundle,
    )


def serve(args: argparse.Namespace, engine_process=None) -> None:
    """`engine_process`: an EngineProcess a spare started ahead (used if the engine runs in one)."""
    _configure_logging(args.log_level)
    if wants_engine_process(args) and engine_process is None:
        from gpuworker.engine.engine_process_client import EngineProcess

        # First thing: the engine process imports torch and the engine while this one goes on.
        engine_process = EngineProcess.start(args.device)
    from gpuworker.checkpoint_files import prefetch

    # Start-up overlaps its stages: a cold checkpoint streams from disk from the first moment,
    # and the engine (torch, CUDA, the weights) loads while the server's own imports (starlette,
    # xgrammar, transformers: seconds) run.
    prefetch(args.model)
    from gpuworker.replica.engine_holder import EngineHolder, ServerConfig

    config = ServerConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        token=args.token,
        max_model_len=args.max_model_len,
        allow_long_context=args.allow_long_context,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        host_kv_cache_bytes=args.host_kv_cache_bytes,
        scheduling=args.scheduling,
        gpu_memory_utilization=args.memory_fraction,
        drain_timeout_s=args.drain_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        expert_parallel=args.expert_parallel,
        engine_process=wants_engine_process(args),
        image_limits=image_limits(args),
    )
    holder = EngineHolder(config, engine_process)
    holder.start_loading()
    from gpuworker.models.loader import TRANSFORMERS_IMPORT_LOCK

    with TRANSFORMERS_IMPORT_LOCK:
        from gpuworker.replica.server import exit_with_parent, run_server

    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    run_server(config, host=args.host, port=args.port, fd=args.fd, log_level=args.log_level, holder=holder)


def spare(args: argparse.Namespace) -> int:
    """A replica process started before its load (gpuworker/replica/spare.py): prepare, wait, serve."""
    import time

    started = time.perf_counter()
    _configure_logging(args.log_level)
    from gpuworker.replica.server import exit_with_parent
    from gpuworker.replica.spare import wait_for_load

    if args.exit_with_parent is not None:
        exit_with_parent(args.exit_with_parent)
    load = wait_for_load(args.device, args.control_fd, started)
    if load is None:
        return 0
    argv, engine_process = load
    serve_args = build_parser().parse_args(["serve", *argv])
    if serve_args.device != args.device:  # the daemon hands each spare loads for its own device only
        print(f"this spare initialised {args.device}, but the load asks for {serve_args.device}", file=sys.stderr)
        return 2
    serve(serve_args, engine_process)
    return 0


def _model_roots(given: list[Path] | None) -> tuple[Path, ...]:
    # The environment is the default only: argparse would append --model-root to a list default.
    if given:
        return tuple(given)
    return tuple(Path(p) for p in os.environ.get(MODEL_ROOTS_ENV, "").split(os.pathsep) if p)


def daemon(args: argparse.Namespace) -> int:
    from gpuworker.daemon.agent import Agent, AgentConfig

    _configure_logging(args.log_level)
    if not args.token:
        print(f"--token (or ${TOKEN_ENV}) is required: the control plane and replicas demand it", file=sys.stderr)
        return 2
    config = AgentConfig(
        control_url=args.control_url.rstrip("/"),
        token=args.token,
        name=args.name,
        advertise_host=args.advertise_host,
        device=args.device,
        port_range=args.port_range,
        state_dir=args.state_dir or Path("var") / "gpuworker" / args.name,
        drain_timeout_s=args.drain_timeout,
        model_roots=_model_roots(args.model_roots),
        stage_budget_bytes=args.stage_budget_bytes,
        host_kv_cache_bytes=args.host_kv_cache_bytes,
        spare_replicas=args.spare_replicas,
        replica_argv=image_fetch_argv(args),
    )
    return Agent(config).run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
        return 0
    if args.command == "spare":
        return spare(args)
    return daemon(args)


if __name__ == "__main__":
    sys.exit(main())
