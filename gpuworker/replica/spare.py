"""A spare replica process: started by the daemon before any load, it pays a replica's fixed start-up
cost (importing torch, the engine, the server with starlette, uvicorn, xgrammar and transformers,
and initialising CUDA on its device: 4-5 s on an H200 host) while nothing waits for it, then waits
for one load. The load's `serve` arguments arrive on a Unix socket (`--control-fd`) with two file
descriptors: the listening socket the daemon bound for the replica and the replica's log file, which
becomes the process's stdout and stderr. From there on it is the replica `serve` would have started.

    daemon                                   spare (python -m gpuworker spare --device cuda:0 ...)
      socketpair(SEQPACKET); Popen(spare)      imports, CUDA init, "spare replica process ready"
      load: send_fds([serve argv], [listener, log])  ->  recv_fds; dup2(log, 1/2); serve(argv + --fd)

The daemon closing its end (or SIGTERM) before a load ends the spare. The message itself is in
gpuworker/contract/spare_handover.py.

On CUDA the replica's engine steps in a process of its own (engine/engine_process_client.py): the
spare starts that process first, and it imports the engine and initialises the device alongside the
spare's own imports; the spare itself then leaves CUDA alone (a load that asks for the engine in
the server's process, --engine-in-process, initialises it then, and stops the unused process).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from gpuworker.contract.spare_handover import READY_LINE, receive_load

if TYPE_CHECKING:
    from gpuworker.engine.engine_process_client import EngineProcess

logger = logging.getLogger(__name__)


def prepare(device: str) -> EngineProcess | None:
    """Import what a replica imports and initialise `device`, before the model is known; on CUDA
    that happens in the engine process started here for the replica (returned)."""
    engine_process = None
    if device.startswith("cuda"):
        from gpuworker.engine.engine_process_client import EngineProcess

        engine_process = EngineProcess.start(device)
    import torch
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: F401  what the tokenizer load imports

    from gpuworker.engine import start_engine  # noqa: F401  the engine, the models, the loader
    from gpuworker.replica import server  # noqa: F401  starlette, uvicorn, xgrammar (which imports transformers)

    if engine_process is not None:
        engine_process.wait_prepared()
    elif device.startswith("cuda"):
        import triton  # noqa: F401  the attention kernels' compiler (the kernels load from its cache)

        torch.cuda.init()
        torch.empty(0, device=device)
    return engine_process


def wait_for_load(device: str, control_fd: int, started: float) -> tuple[list[str], EngineProcess | None] | None:
    """The spare's life before its load (from perf_counter `started`): prepare, then the `serve`
    argv to run (with --fd), its output redirected to the replica's log, and the engine process
    started for it; None when no load came (the daemon let it go)."""
    engine_process = prepare(device)
    logger.info("%s on %s in %.2fs (pid %d)", READY_LINE, device, time.perf_counter() - started, os.getpid())
    control = socket.socket(fileno=control_fd)
    try:
        load = receive_load(control)
    finally:
        control.close()
    if load is None:
        logger.info("the daemon let this spare go before any load")
        if engine_process is not None:
            engine_process.stop()
        return None
    argv, listener_fd, log_fd = load
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if engine_process is not None:
        engine_process.share_output()
    # At once: the daemon reads a replica log still empty at the process's death as a load never
    # taken (a spare killed as it was handed over), and starts the load afresh.
    logger.info(
        "spare pid %d on %s took the load, %.2fs after it started", os.getpid(), device, time.perf_counter() - started
    )
    return [*argv, "--fd", str(listener_fd)], engine_process
