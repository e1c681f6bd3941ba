"""A failed replica's error: its cause read out of real logs, put first and whole."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import textwrap

from gpuworker.contract.heartbeat import MAX_REPLICA_ERROR_CHARS
from gpuworker.daemon.replica_errors import error_cause, failure_message

# A real CUDA out-of-memory failure, in the replica's log format (gpuworker/__main__.py) and logged as
# the engine holder logs a failed load: torch 2.11 on an H200, captured 2026-12-01; uvicorn's lines
# follow, as they do in a replica's log.
CUDA_OOM_LOG = """\
2026-12-01 19:34:35,103 INFO gpuworker.replica.engine_holder: loading /models/llama-3-8b
2026-12-01 19:34:35,532 ERROR gpuworker.replica.engine_holder: loading /models/llama-3-8b failed
Traceback (most recent call last):
  File "/tmp/oom.py", line 6, in <module>
    weights = torch.empty(2**46, dtype=torch.bfloat16, device="cuda:0")
              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 131072.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 139.29 GiB is free. Including non-PyTorch memory, this process has 518.00 MiB memory in use. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)
INFO:     Started server process [4242]
INFO:     Waiting for application startup.
"""  # noqa: E501 - a captured log, verbatim


def _run(code: str, *, status: int = 1) -> str:
    """The output of a real Python process running `code`, which ends with `status`."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == status, result
    return result.stdout + result.stderr


def test_the_cause_of_a_chained_traceback_is_the_exception_raised_last():
    log = _run("""
        import logging
        logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("gpuworker.replica").info("loading /models/x")
        try:
            open("/no/such/dir/model.safetensors")
        except OSError as exc:
            raise RuntimeError("reading the weights of /models/x failed") from exc
    """)
    assert "FileNotFoundError" in log and "direct cause" in log
    assert error_cause(log) == "RuntimeError: reading the weights of /models/x failed"

    during = _run("""
        try:
            {}["missing"]
        except KeyError:
            import json; json.loads("{not json")
    """)
    assert "During handling of the above exception" in during
    assert error_cause(during).startswith("json.decoder.JSONDecodeError: Expecting property name")


def test_only_the_first_line_of_a_long_exception_message_is_the_cause():
    log = _run("""
        raise ValueError("max_model_len 9000 is more than the model's 8192\\nset --max-model-len to at most 8192")
    """)
    assert error_cause(log) == "ValueError: max_model_len 9000 is more than the model's 8192"


def test_a_cuda_out_of_memory_error_is_found_whole_among_the_log_lines_after_it():
    cause = error_cause(CUDA_OOM_LOG)
    assert cause.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 131072.00 GiB.")
    assert cause.endswith(
        "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
    )


def test_a_port_clash_logged_by_uvicorn_without_a_traceback_is_the_cause():
    """The failure of the issue: uvicorn logs the bind error as a plain ERROR line and exits 1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = _run(
            f"""
            import uvicorn
            async def app(scope, receive, send):
                pass
            uvicorn.run(app, host="127.0.0.1", port={port}, lifespan="off")
        """,
            status=3,
        )  # uvicorn's STARTUP_FAILURE
    cause = error_cause(log)
    assert cause.startswith("[Errno 98] error while attempting to bind on address ('127.0.0.1', ")
    assert cause.endswith("address already in use")


def test_a_killed_process_has_no_cause_in_its_log():
    log = _run(
        """
        import os, signal
        print("2026-12-01 19:40:02,118 INFO gpuworker.replica.engine_holder: loading /models/x", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """,
        status=-signal.SIGKILL,
    )
    assert error_cause(log) == ""
    assert error_cause("") == ""


def test_the_message_puts_the_cause_first_whole_and_fits_the_contract():
    noise = "".join(f'INFO:     127.0.0.1:5{i:04d} - "POST /v1/completions HTTP/1.1" 200 OK\n' for i in range(400))
    log = CUDA_OOM_LOG + noise  # the cause lies far above the end
    message = failure_message(cause=error_cause(log), what="the replica process exited with status 1", log_text=log)
    first, second, third = message.split("\n", 3)[:3]
    assert first == error_cause(CUDA_OOM_LOG) and len(first) > 500
    assert second == "the replica process exited with status 1; last log lines:"
    assert third.startswith("INFO:     127.0.0.1:5")  # the tail starts at a line's start
    assert len(message) <= MAX_REPLICA_ERROR_CHARS
    assert message.endswith(noise.strip().splitlines()[-1])

    killed = failure_message(cause="", what="the replica process was killed by SIGKILL", log_text="loading\n")
    assert killed == "the replica process was killed by SIGKILL; last log lines:\nloading"
    huge = failure_message(cause="E" * 10_000, what="exited", log_text="log")
    assert huge == "E" * MAX_REPLICA_ERROR_CHARS
