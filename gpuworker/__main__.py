"""Command line of the GPU worker.

    python -m gpuworker serve --model PATH --port 8100 [--device cpu|cuda] [--dtype auto]
    python -m gpuworker daemon ...   (the host agent; not implemented yet)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gpuworker")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve one model over the OpenAI-compatible API")
    serve.add_argument("--model", required=True, help="directory of a Hugging Face checkpoint")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--token", default=os.environ.get("GPUWORKER_TOKEN"),
                       help="require 'Authorization: Bearer TOKEN' (default: $GPUWORKER_TOKEN)")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--memory-fraction", type=float, default=0.9,
                       help="fraction of free GPU memory the KV cache may take")
    serve.add_argument("--log-level", default="info")

    # The host agent (issue 5 item 2) gets its own subcommand here:
    # commands.add_parser("daemon", ...) with --control-url, --token, --host-name, --device,
    # --advertise-host, --port-range.
    return parser


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from gpuworker.server import ServerConfig, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(ServerConfig(model=args.model, served_model_name=args.served_model_name,
                                 device=args.device, dtype=args.dtype, token=args.token,
                                 max_model_len=args.max_model_len,
                                 gpu_memory_utilization=args.memory_fraction))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        serve(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
