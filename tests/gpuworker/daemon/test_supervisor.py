"""The replica supervisor with real `python -m gpuworker serve` children on CPU."""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest

from gpuworker.contract.heartbeat import ReplicaReport
from gpuworker.contract.tasks import LoadModel
from gpuworker.daemon.hardware import HardwareError, HardwareProbe
from gpuworker.daemon.supervisor import Supervisor, image_limit_arguments, load_devices
from tests.processes import children_running

TOKEN = "replica-token"


def _entry(supervisor: Supervisor, replica_id: int, *states: str) -> ReplicaReport | None:
    for entry in supervisor.snapshot():
        if entry.replica_id == replica_id and (not states or entry.state in states):
            return entry
    return None


def _wait(supervisor: Supervisor, replica_id: int, *states: str, timeout: float = 60.0) -> ReplicaReport:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (entry := _entry(supervisor, replica_id, *states)) is not None:
            return entry
        time.sleep(0.05)
    raise AssertionError(f"replica {replica_id} never reached {states}: {supervisor.snapshot()}")


# Replica processes other test modules of the same session keep running (session fixtures).
_OTHERS: set[int] = set()


def _serve_children() -> list[psutil.Process]:
    return [p for p in children_running("serve", argument=True) if p.pid not in _OTHERS]


def _started_supervisor(tmp_path, tmp_path_factory, monkeypatch, **options) -> Supervisor:
    """A CPU worker's supervisor, started; `options` are Supervisor's own (a host KV tier, ...)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # children inherit it: tiny models need no threads
    _OTHERS.clear()
    _OTHERS.update(p.pid for p in children_running("serve", argument=True))
    # Any free port (the default). The session's temporary folder holds tmp_path and every tiny checkpoint.
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=0,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="test-host",
        model_roots=(tmp_path_factory.getbasetemp(),),
        **options,
    )
    supervisor.start()
    return supervisor


def _complete(endpoint_url: str, *, timeout: float) -> httpx.Response:
    """A two-token completion from the replica at `endpoint_url`, with the worker token."""
    return httpx.post(
        f"{endpoint_url}/v1/completions",
        headers={"Authorization": f"Bearer {TOKEN}"},
        json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True},
        timeout=timeout,
    )


@pytest.fixture
def supervisor(tmp_path, tmp_path_factory, monkeypatch):
    supervisor = _started_supervisor(tmp_path, tmp_path_factory, monkeypatch)
    yield supervisor
    supervisor.close(drain_timeout_s=5)
    assert _serve_children() == []


def test_bad_loads_fail_with_a_reason_before_any_process_starts(supervisor, tmp_path, tiny_checkpoint):
    def load(replica_id: int, model_path, gpu_index=None) -> None:
        supervisor.load(
            LoadModel(
                replica_id=replica_id,
                model_path=str(model_path),
                served_model_name="m",
                gpu_index=gpu_index,
                memory_fraction=0.5,
            )
        )

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    load(1, tmp_path / "no" / "such" / "model")
    load(2, tmp_path / "empty")
    load(3, tmp_path / "file")
    load(4, tiny_checkpoint("llama"), gpu_index=0)
    (tmp_path / "two-ggufs").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two-ggufs" / name).write_bytes(b"GGUF")
    load(6, tmp_path / "two-ggufs")
    errors = {i: _wait(supervisor, i, "failed", timeout=5).error for i in (1, 2, 3, 4, 6)}
    assert errors[1] == f"model path {tmp_path / 'no' / 'such' / 'model'} does not exist"
    assert errors[2].endswith(
        "has no config.json or .gguf file (expected a Hugging Face model directory or a GGUF checkpoint)"
    )
    assert errors[3] == f"model path {tmp_path / 'file'} is not a directory or a .gguf file"
    assert errors[4] == "gpu_index 0 was requested, but this worker has no GPU"
    assert "holds 2 .gguf files" in errors[6]
    assert _serve_children() == []
    supervisor.refuse_loads = True
    load(5, tiny_checkpoint("llama"))
    assert _wait(supervisor, 5, "failed", timeout=5).error == "worker test-host is draining and takes no new loads"


def test_loads_from_outside_the_model_roots_are_refused_however_the_path_escapes(tmp_path, tiny_checkpoint):
    """`..` segments and symlinks are resolved before the check; a daemon without roots loads nothing."""
    outside = tiny_checkpoint("llama")
    root = tmp_path / "models"
    root.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    dotdot = f"{root}/{os.path.relpath(outside, root)}"
    assert ".." in dotdot and (Path(dotdot) / "config.json").is_file()

    def supervised(roots) -> Supervisor:
        return Supervisor(
            token=TOKEN,
            gpu_count=0,
            advertise_host="127.0.0.1",
            bind_host="127.0.0.1",
            state_dir=tmp_path / "state",
            worker_name="test-host",
            model_roots=roots,
        )

    confined, unconfined = supervised((root,)), supervised(())
    for s in (confined, unconfined):
        s.start()
    try:
        for replica_id, path in ((1, dotdot), (2, root / "link")):
            confined.load(
                LoadModel(
                    replica_id=replica_id,
                    model_path=str(path),
                    served_model_name="m",
                    gpu_index=None,
                    memory_fraction=0.5,
                )
            )
        unconfined.load(
            LoadModel(replica_id=3, model_path=str(outside), served_model_name="m", gpu_index=None, memory_fraction=0.5)
        )
        errors = {i: _wait(confined, i, "failed", timeout=5).error for i in (1, 2)}
        errors[3] = _wait(unconfined, 3, "failed", timeout=5).error
    finally:
        for s in (confined, unconfined):
            s.close(drain_timeout_s=5)
    for replica_id in (1, 2):
        assert f"(resolved: {outside})" in errors[replica_id]
        assert errors[replica_id].endswith(
            f"lies outside this worker's model roots ({root}); move the checkpoint "
            "under one or start the daemon with another --model-root"
        )
    assert errors[3].startswith(
        "this worker has no model root, so it loads no model: start its daemon with --model-root DIR"
    )
    assert not [p for p in children_running("serve", argument=True) if str(outside) in p.cmdline()]


def test_a_tensor_parallel_load_past_the_last_gpu_fails_before_any_process_starts(
    tmp_path, tmp_path_factory, tiny_checkpoint
):
    before = set(_serve_children())  # other tests' replicas may be running in this process
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=2,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="test-host",
        model_roots=(tmp_path_factory.getbasetemp(),),
    )
    supervisor.start()
    try:
        supervisor.load(
            LoadModel(
                replica_id=1,
                model_path=str(tiny_checkpoint("llama")),
                served_model_name="m",
                gpu_index=1,
                memory_fraction=0.5,
                tensor_parallel_size=2,
            )
        )
        error = _wait(supervisor, 1, "failed", timeout=120).error
    finally:
        supervisor.close(drain_timeout_s=5)
    assert error == "tensor_parallel_size 2 from gpu_index 1 needs GPUs 1-2; this worker has 2 (0-1)"
    assert set(_serve_children()) == before


@pytest.mark.parametrize(("tensor_parallel_size", "needed"), [(1, 4), (2, 4)])
def test_weights_larger_than_their_gpus_fail_the_load_with_the_gpus_they_need(
    tmp_path, tmp_path_factory, tiny_checkpoint, tensor_parallel_size, needed
):
    """Each GPU a third of the checkpoint's weights: one or two GPUs cannot hold them, four can;
    refused before any process starts."""
    from gpuworker.checkpoint_files import weight_bytes

    before = set(_serve_children())
    path = tiny_checkpoint("llama")
    weights = weight_bytes(path)
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=4,
        gpu_memory_bytes=(weights // 3,) * 4,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="test-host",
        model_roots=(tmp_path_factory.getbasetemp(),),
    )
    supervisor.start()
    try:
        supervisor.load(
            LoadModel(
                replica_id=1,
                model_path=str(path),
                served_model_name="m",
                gpu_index=0,
                memory_fraction=0.5,
                tensor_parallel_size=tensor_parallel_size,
            )
        )
        error = _wait(supervisor, 1, "failed", timeout=30).error
    finally:
        supervisor.close(drain_timeout_s=5)
    gib = 1024**3
    assert error == (
        f"model path {path}: its weights ({weights / gib:.1f} GiB) do not fit on {tensor_parallel_size} GPU(s) of "
        f"{weights // 3 / gib:.1f} GiB (tensor_parallel_size {tensor_parallel_size}); they alone need {needed} "
        "GPUs of this size"
    )
    assert set(_serve_children()) == before


@pytest.mark.slow
def test_a_tensor_parallel_replica_is_one_replica_with_its_ranks_below_it(supervisor, tiny_checkpoint):
    """The daemon starts one serve process; its second rank is that process's child, and stopping
    the replica stops both."""
    supervisor.load(
        LoadModel(
            replica_id=8,
            model_path=str(tiny_checkpoint("llama")),
            served_model_name="tp",
            gpu_index=None,
            memory_fraction=0.5,
            max_model_len=128,
            tensor_parallel_size=2,
        )
    )
    ready = _wait(supervisor, 8, "ready", "failed", timeout=120)
    assert ready.state == "ready", ready.error
    [child] = _serve_children()
    assert "--tensor-parallel-size" in child.cmdline()
    ranks = [p for p in child.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(ranks) == 1
    completion = _complete(ready.endpoint_url, timeout=60)
    assert completion.status_code == 200
    supervisor.unload(8, drain_timeout_s=5)
    assert _wait(supervisor, 8, "stopped", timeout=60).error == ""
    assert not ranks[0].is_running() or ranks[0].status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_a_load_past_the_checkpoints_context_is_served_only_when_allowed(supervisor, tiny_checkpoint):
    """The tiny checkpoint has 1,024 positions: 1,536 without allow_long_context fails the load,
    saying what to set; with it the replica serves 1,536."""
    load = dict(model_path=str(tiny_checkpoint("llama")), gpu_index=None, memory_fraction=0.5, max_model_len=1536)
    supervisor.load(LoadModel(replica_id=13, served_model_name="tiny-short", **load))
    failed = _wait(supervisor, 13, "ready", "failed", timeout=120)
    assert failed.state == "failed"
    assert "max_model_len (1536) exceeds the model's context (1024 positions)" in failed.error
    assert "allow_long_context" in failed.error
    supervisor.load(LoadModel(replica_id=14, served_model_name="tiny-long", allow_long_context=True, **load))
    ready = _wait(supervisor, 14, "ready", "failed", timeout=120)
    assert ready.state == "ready", ready.error
    [child] = [c for c in _serve_children() if "tiny-long" in c.cmdline()]
    assert "--allow-long-context" in child.cmdline()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    models = httpx.get(f"{ready.endpoint_url}/v1/models", headers=auth, timeout=10).json()["data"]
    assert models[0]["max_model_len"] == 1536
    supervisor.unload(14, drain_timeout_s=5)
    assert _wait(supervisor, 14, "stopped", timeout=60).error == ""


@pytest.mark.slow
def test_a_load_asking_for_fp8_serves_the_float_checkpoint_quantized_to_fp8(supervisor, tiny_checkpoint, tmp_path):
    supervisor.load(
        LoadModel(
            replica_id=11,
            model_path=str(tiny_checkpoint("llama")),
            served_model_name="tiny-fp8",
            gpu_index=None,
            memory_fraction=0.5,
            max_model_len=128,
            quantization="fp8",
        )
    )
    ready = _wait(supervisor, 11, "ready", "failed", timeout=120)
    assert ready.state == "ready", ready.error
    [child] = _serve_children()
    argv = child.cmdline()
    assert argv[argv.index("--quantization") + 1] == "fp8"
    # The replica's own account of what it loaded: the engine's quantization, not the flag echoed.
    log = (tmp_path / "replicas" / "replica-11.log").read_text()
    assert "model tiny-fp8 ready in" in log and ", fp8 weights:" in log
    completion = _complete(ready.endpoint_url, timeout=60)
    assert completion.status_code == 200
    supervisor.unload(11, drain_timeout_s=5)
    assert _wait(supervisor, 11, "stopped", timeout=60).error == ""


@pytest.mark.slow
def test_load_is_idempotent_and_a_dead_child_is_reported_with_its_log(supervisor, tiny_checkpoint, tmp_path):
    from gpuworker.__main__ import build_parser, image_fetch_argv, image_limits

    bundle = tmp_path / "ca.pem"
    bundle.write_text("not read until an https image is fetched")
    daemon_args = ["daemon", "--control-url", "http://cp", "--allowed-image-domains", "images.test"]
    daemon_args += ["--image-ca-bundle", str(bundle)]
    supervisor.replica_argv = image_fetch_argv(build_parser().parse_args(daemon_args))
    request = LoadModel(
        replica_id=7,
        model_path=str(tiny_checkpoint("llama")),
        served_model_name="tiny",
        gpu_index=None,
        memory_fraction=0.5,
        max_model_len=128,
        max_image_pixels=4096,
    )
    supervisor.load(request)
    loading = _wait(supervisor, 7, timeout=5)
    assert loading.state == "loading" and loading.endpoint_url.startswith("http://127.0.0.1:")
    ready = _wait(supervisor, 7, "ready")
    assert ready.figures["load_progress"] == 1.0 and ready.error == ""
    [child] = _serve_children()
    assert ready.pid == child.pid  # the heartbeat names the process serving the replica
    argv = child.cmdline()  # the load's image limit and the daemon's fetch policy reached the replica
    limits = image_limits(build_parser().parse_args(argv[argv.index("serve") :]))
    assert (limits.max_image_pixels, limits.allowed_domains, limits.ca_bundle) == (4096, ("images.test",), str(bundle))
    # The child demands the worker token; it got it through its environment, not its command line.
    assert httpx.get(f"{ready.endpoint_url}/v1/models").status_code == 401
    assert TOKEN not in " ".join(child.cmdline())
    completion = _complete(ready.endpoint_url, timeout=30)
    assert completion.status_code == 200 and completion.json()["model"] == "tiny"

    supervisor.load(request)  # a repeat changes nothing
    time.sleep(1.2)  # two poll rounds
    assert [p.pid for p in _serve_children()] == [child.pid] and _entry(supervisor, 7, "ready")

    os.kill(child.pid, signal.SIGKILL)  # as the OOM killer would
    failed = _wait(supervisor, 7, "failed", timeout=10)
    assert failed.error.startswith("the replica process was killed by SIGKILL; last log lines:")
    assert failed.pid is None  # no process serves it any more
    assert "model tiny ready" in failed.error  # the tail of the child's own log

    supervisor.load(request)  # a failed replica may be loaded again: a fresh process
    _wait(supervisor, 7, "loading", timeout=5)
    supervisor.unload(7, drain_timeout_s=5)  # while it is still starting: stopped at once
    assert _wait(supervisor, 7, "stopped", timeout=15).error == ""
    assert _serve_children() == []


@pytest.mark.slow
def test_a_port_taken_while_the_replica_starts_cannot_fail_its_load(tmp_path, tmp_path_factory, tiny_checkpoint):
    """The issue's failure: the daemon chose a free port, and another process bound it while the
    child was still importing; the child died on `[Errno 98] address already in use` and the load
    failed. Here something tries to take the replica's port the moment it is reported, with a
    configured range (an operator's firewall) as the fixed ranges of the test daemons had."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = min(probe.getsockname()[1], 65000)
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=0,
        port_range=(base, base + 20),
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="test-host",
        model_roots=(tmp_path_factory.getbasetemp(),),
    )
    supervisor.start()
    intruder = socket.socket()
    intruder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers (uvicorn too) do
    try:
        supervisor.load(
            LoadModel(
                replica_id=1,
                model_path=str(tiny_checkpoint("llama")),
                served_model_name="tiny",
                gpu_index=None,
                memory_fraction=0.5,
                max_model_len=128,
            )
        )
        loading = _wait(supervisor, 1, timeout=10)
        port = urlsplit(loading.endpoint_url).port
        assert loading.state == "loading" and base <= port <= base + 20
        try:
            intruder.bind(("127.0.0.1", port))
            intruder.listen()
        except OSError as exc:  # the port is held from the moment it is known
            assert exc.errno == errno.EADDRINUSE
        ready = _wait(supervisor, 1, "ready", "failed")
        assert ready.state == "ready", ready.error
        with pytest.raises(OSError):  # the replica holds it now
            intruder.bind(("127.0.0.1", port))
        assert ready.endpoint_url == loading.endpoint_url
        assert "ttft_p95_s" not in ready.figures  # no request yet: absent, not 0
        completion = _complete(ready.endpoint_url, timeout=30)
        assert completion.status_code == 200
        # The replica's latency figures reach the heartbeat with its next poll.
        deadline = time.monotonic() + 30
        while "ttft_p95_s" not in _entry(supervisor, 1).figures and time.monotonic() < deadline:
            time.sleep(0.1)
        figures = _entry(supervisor, 1).figures
        assert figures["ttft_p95_s"] > 0 and figures["itl_p95_s"] > 0
    finally:
        intruder.close()
        supervisor.close(drain_timeout_s=5)


@pytest.mark.slow
def test_a_replica_that_fails_to_load_reports_its_cause_first(supervisor, tiny_checkpoint, unreadable_checkpoint):
    """A checkpoint whose weights are unreadable: the replica's own error leads, whole, then its log."""
    broken = unreadable_checkpoint
    supervisor.load(
        LoadModel(
            replica_id=3,
            model_path=str(broken),
            served_model_name="tiny",
            gpu_index=None,
            memory_fraction=0.5,
            max_model_len=128,
        )
    )
    failed = _wait(supervisor, 3, "failed", timeout=60)
    cause, what = failed.error.split("\n")[:2]
    assert cause.startswith("ValueError: model.safetensors is not a safetensors file or is truncated"), failed.error
    assert what == "the replica failed to load; last log lines:"
    assert "Traceback (most recent call last):" in failed.error

    # Loaded again at once (the failed process may still be stopping: the new one waits for it, so
    # it is reaped, not left a zombie), the replica writes on in the same log; its next death is
    # judged by its own lines.
    supervisor.load(
        LoadModel(
            replica_id=3,
            model_path=str(tiny_checkpoint("llama")),
            served_model_name="tiny",
            gpu_index=None,
            memory_fraction=0.5,
            max_model_len=128,
        )
    )
    _wait(supervisor, 3, "ready")
    assert not [p for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
    [child] = _serve_children()
    os.kill(child.pid, signal.SIGABRT)  # as a C++ terminate would
    aborted = _wait(supervisor, 3, "failed", timeout=10).error
    assert aborted.startswith("the replica process was killed by SIGABRT; last log lines:\n"), aborted
    assert "not a safetensors file" not in aborted and "model tiny ready" in aborted


def _gpu_count() -> int:
    try:
        probe = HardwareProbe("cuda")
    except HardwareError:
        return 0
    try:
        return probe.gpu_count
    finally:
        probe.close()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() == 0, reason="no GPU visible to NVML")
def test_replica_on_a_gpu(tmp_path, tmp_path_factory, tiny_checkpoint):
    probe = HardwareProbe("cuda")
    supervisor = Supervisor(
        token=TOKEN,
        gpu_count=probe.gpu_count,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path,
        worker_name="gpu",
        model_roots=(tmp_path_factory.getbasetemp(),),
    )
    supervisor.start()
    try:
        used_before = probe.sample()["gpus"][0]["memory_used_bytes"]
        supervisor.load(
            LoadModel(
                replica_id=1,
                model_path=str(tiny_checkpoint("llama")),
                served_model_name="tiny",
                gpu_index=0,
                memory_fraction=0.05,
                max_model_len=256,
                dtype="bfloat16",
            )
        )
        ready = _wait(supervisor, 1, "ready", "failed", timeout=180)
        assert ready.state == "ready", ready.error
        [child] = _serve_children()
        assert "cuda:0" in child.cmdline()
        completion = httpx.post(
            f"{ready.endpoint_url}/v1/completions",
            headers={"Authorization": f"Bearer {TOKEN}"},
            json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True},
            timeout=60,
        )
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 8
        # The replica process (its CUDA context, weights and KV pool) shows in NVML's figures for the GPU.
        assert probe.sample()["gpus"][0]["memory_used_bytes"] > used_before + 100 * 2**20
        supervisor.unload(1, drain_timeout_s=5)
        _wait(supervisor, 1, "stopped", timeout=30)
    finally:
        supervisor.close(drain_timeout_s=5)
        probe.close()
    assert _serve_children() == []


def test_a_split_load_runs_on_each_of_its_gpus():
    """What the spares keep off while a load is in progress: every GPU of a split replica."""

    def load(gpu_index, size):
        return LoadModel(
            replica_id=1,
            model_path="/m",
            served_model_name="m",
            gpu_index=gpu_index,
            memory_fraction=0.5,
            tensor_parallel_size=size,
        )

    assert load_devices(load(1, 2)) == ["cuda:1", "cuda:2"]
    assert load_devices(load(0, 1)) == ["cuda:0"]
    assert load_devices(load(None, 2)) == ["cpu"]


def test_the_workers_host_kv_tier_reaches_each_replica(tmp_path, tmp_path_factory, tiny_checkpoint, monkeypatch):
    """--host-kv-cache-bytes of the daemon: every replica it starts keeps a host KV tier that size."""
    from gpuworker.__main__ import build_parser

    base = ["daemon", "--control-url", "http://cp", "--token", "t"]
    assert build_parser().parse_args([*base, "--host-kv-cache-bytes", "1048576"]).host_kv_cache_bytes == 1 << 20
    monkeypatch.setenv("GPUSERVE_HOST_KV_CACHE_BYTES", "2048")
    assert build_parser().parse_args(base).host_kv_cache_bytes == 2048
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--host-kv-cache-bytes", "lots"])
    supervisor = _started_supervisor(tmp_path, tmp_path_factory, monkeypatch, host_kv_cache_bytes=1 << 20)
    try:
        supervisor.load(
            LoadModel(
                replica_id=12,
                model_path=str(tiny_checkpoint("llama")),
                served_model_name="tiered",
                gpu_index=None,
                memory_fraction=0.5,
                max_model_len=128,
            )
        )
        ready = _wait(supervisor, 12, "ready", "failed", timeout=120)
        assert ready.state == "ready", ready.error
        [child] = _serve_children()
        assert "--host-kv-cache-bytes" in child.cmdline() and str(1 << 20) in child.cmdline()
        health = httpx.get(f"{ready.endpoint_url}/health", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert health["limits"]["host_kv_cache_tokens"] > 0
        assert "host_cache_hit_rate" in ready.figures
    finally:
        supervisor.close(drain_timeout_s=5)
    assert _serve_children() == []


def test_a_daemon_with_a_ca_bundle_that_is_no_file_stops_before_it_starts(tmp_path, capsys):
    from gpuworker.__main__ import build_parser

    argv = ["daemon", "--control-url", "http://cp", "--image-ca-bundle", str(tmp_path / "missing.pem")]
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(argv)
    assert stopped.value.code == 2 and "missing.pem' is not a file" in capsys.readouterr().err


def test_a_loads_image_limits_become_the_replicas_image_limits():
    """The catalog's limits travel in the load message, become serve flags, and the replica's
    server builds its ImageLimits from them; limits the load leaves unset keep the replica's defaults."""
    from gpuworker.__main__ import build_parser, image_limits
    from gpuworker.replica.images import ImageLimits

    def limits_of(request: LoadModel) -> ImageLimits:
        return image_limits(build_parser().parse_args(["serve", "--model", "m", *image_limit_arguments(request)]))

    base = {"replica_id": 1, "model_path": "/m", "served_model_name": "m", "gpu_index": None, "memory_fraction": 0.5}
    limited = LoadModel(
        **base, max_images_per_request=2, max_image_bytes=5000, max_image_pixels=640 * 480, low_detail_pixels=300
    )
    assert limits_of(limited) == ImageLimits(
        max_images=2, max_image_bytes=5000, max_image_pixels=640 * 480, low_detail_pixels=300
    )
    assert limits_of(LoadModel(**base)) == ImageLimits()
    with pytest.raises(ValueError, match="max_image_pixels must be an integer >= 1"):
        LoadModel(**base, max_image_pixels=0)
