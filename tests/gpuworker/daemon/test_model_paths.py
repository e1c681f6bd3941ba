"""The daemon reports the checkpoints under its model roots: the scan itself, and registration plus
heartbeats against the real control plane (Django's live server), where the catalog reads them."""

import json
from pathlib import Path

import pytest

from gpuworker.contract.heartbeat import WorkerRegistration
from gpuworker.daemon.agent import Agent, AgentConfig
from gpuworker.daemon.hardware import HardwareProbe
from gpuworker.daemon.model_paths import scan_model_roots
from gpuworker.daemon.supervisor import Supervisor


def _checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_scan_finds_checkpoint_directories_to_a_bounded_depth(tmp_path):
    root = tmp_path / "models"
    llama = _checkpoint(root / "llama-8b")
    _checkpoint(root / "llama-8b" / "original")  # inside a checkpoint: not a separate model
    nested = _checkpoint(root / "org" / "qwen" / "main")
    _checkpoint(root / "a" / "b" / "c" / "too-deep")
    _checkpoint(root / ".cache" / "hidden")
    (root / "empty").mkdir()
    scan = scan_model_roots([root, tmp_path / "missing"])
    assert scan.roots == (str(root), str(tmp_path / "missing"))
    assert scan.paths == (str(llama), str(nested))


def test_a_root_that_is_itself_a_checkpoint_is_reported(tmp_path):
    model = _checkpoint(tmp_path / "one-model")
    assert scan_model_roots([model / ".." / "one-model"]).paths == (str(model),)


def test_a_folder_holding_a_gguf_file_is_a_checkpoint(tmp_path):
    root = tmp_path / "models"
    smollm2 = root / "smollm2"
    smollm2.mkdir(parents=True)
    (smollm2 / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a model")
    assert scan_model_roots([root]).paths == (str(smollm2),)


def test_quantized_checkpoints_are_reported_with_their_quantization(tmp_path):
    root = tmp_path / "models"
    _checkpoint(root / "llama-8b")
    awq = _checkpoint(root / "llama-8b-awq")
    (awq / "config.json").write_text(
        json.dumps(
            {
                "quantization_config": {
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": 128,
                    "zero_point": True,
                    "version": "gemm",
                }
            }
        )
    )
    fp8 = _checkpoint(root / "llama-8b-fp8")
    (fp8 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    # Not served (its load will say why) or unreadable: reported as a checkpoint, without a quantization.
    (_checkpoint(root / "act-order") / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}})
    )
    (_checkpoint(root / "garbled") / "config.json").write_text("{not json")
    scan = scan_model_roots([root])
    assert len(scan.paths) == 5
    assert scan.quantization == ((str(awq), "awq-int4"), (str(fp8), "fp8"))


@pytest.mark.django_db(transaction=True)
def test_registration_and_heartbeats_carry_the_scan_to_the_control_plane(tmp_path, live_server, settings):
    from controlplane.fleet.models import Worker

    root = tmp_path / "models"
    first = _checkpoint(root / "first")
    config = AgentConfig(
        control_url=live_server.url,
        token=settings.FLEET_WORKER_TOKEN,
        name="scan-test",
        advertise_host="127.0.0.1",
        device="cpu",
        state_dir=tmp_path / "state",
        model_roots=(root,),
    )
    agent = Agent(config)
    agent.probe = HardwareProbe("cpu")
    agent.supervisor = Supervisor(
        token="t",
        gpu_count=0,
        advertise_host="127.0.0.1",
        bind_host="127.0.0.1",
        state_dir=tmp_path / "state",
        worker_name="scan-test",
        model_roots=(root,),
    )
    agent._registration = WorkerRegistration(
        name="scan-test",
        advertise_host="127.0.0.1",
        device="cpu",
        gpus=(),
        cpu_memory_total_bytes=2**30,
        cpu_cores=2,
        version="test",
    )
    try:
        agent._register()
        worker = Worker.objects.get(name="scan-test")
        assert (worker.model_roots, worker.model_paths) == ([str(root)], [str(first)])
        heartbeat = agent._heartbeat()
        # Unchanged since registration: not resent.
        assert "models" not in heartbeat.to_json() and heartbeat.models is None
        second = _checkpoint(root / "second")
        (second / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
        agent._model_scan_at -= 60  # the next scan is due
        agent._beat()
        worker.refresh_from_db()
        assert worker.model_paths == [str(first), str(second)]
        assert worker.model_quantization == {str(second): "fp8"}
        heartbeat = agent._heartbeat()
        assert "models" not in heartbeat.to_json()  # acknowledged by the last heartbeat
    finally:
        agent._control.close()
        agent.probe.close()
