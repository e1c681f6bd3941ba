"""The registration and heartbeat messages: parsed with every field checked, and built by the daemon
in the form the control plane parses back."""

import pytest

from gpuworker.contract.heartbeat import (
    CheckpointReport,
    ContractError,
    GpuSpec,
    Heartbeat,
    ModelPaths,
    ReplicaReport,
    StagedWeights,
    Staging,
    WorkerRegistration,
    parse_heartbeat,
    parse_registration,
)

REGISTRATION = {
    "name": "host-a",
    "advertise_host": "127.0.0.1",
    "device": "cuda",
    "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_total_bytes": 150_000_000_000}],
    "cpu": {"memory_total_bytes": 64 * 1024**3, "cores": 16},
    "version": "0.1.0",
}


def _error_fields(parse, data) -> str:
    with pytest.raises(ContractError) as error:
        parse(data)
    return error.value.field


def test_registration_parses():
    registration = parse_registration(REGISTRATION)
    assert registration.name == "host-a" and registration.gpus[0].memory_total_bytes == 150_000_000_000
    assert (registration.cpu_memory_total_bytes, registration.cpu_cores) == (64 * 1024**3, 16)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"device": "tpu"}, "device"),
        ({"name": ""}, "name"),
        ({"gpus": [{"index": -1, "name": "x", "memory_total_bytes": 1}]}, "gpus[0].index"),
        ({"gpus": [{"index": 0, "name": "x", "memory_total_bytes": "lots"}]}, "gpus[0].memory_total_bytes"),
        ({"gpus": []}, "gpus"),
        ({"gpus": [{"index": 0, "name": "x", "memory_total_bytes": 1}] * 2}, "gpus"),
        ({"cpu": {"cores": True}}, "cpu.cores"),
    ],
)
def test_bad_registrations_name_the_field(change, field):
    assert field == _error_fields(parse_registration, {**REGISTRATION, **change})


def test_a_cpu_worker_registers_without_gpus():
    assert parse_registration({**REGISTRATION, "device": "cpu", "gpus": []}).gpus == ()


def test_heartbeat_parses_figures_and_leaves_out_missing_ones():
    heartbeat = parse_heartbeat(
        {
            "sent_at": "2026-01-01T00:00:00Z",
            "draining": False,
            "gpus": [{"index": 0, "utilization_pct": 37.0, "temperature_c": None}],
            "cpu": {"utilization_pct": 12.0},
            "replicas": [
                {
                    "replica_id": 12,
                    "state": "ready",
                    "endpoint_url": "http://127.0.0.1:8101",
                    "load_progress": 1.0,
                    "running": 2,
                    "waiting": 0,
                }
            ],
        }
    )
    assert heartbeat.gpus == ({"index": 0, "utilization_pct": 37.0},)
    assert heartbeat.replicas[0].figures == {"load_progress": 1.0, "running": 2, "waiting": 0}
    # A daemon that does not report its replicas' processes (an older one) is still understood.
    assert heartbeat.replicas[0].pid is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({"draining": "no"}, "draining"),
        ({"replicas": [{"replica_id": 1, "state": "sleeping"}]}, "replicas[0].state"),
        ({"replicas": [{"replica_id": 1, "state": "ready"}]}, "replicas[0].endpoint_url"),
        (
            {"replicas": [{"replica_id": 1, "state": "ready", "endpoint_url": "gpuworker:8001"}]},
            "replicas[0].endpoint_url",
        ),
        ({"replicas": [{"replica_id": 0, "state": "loading"}]}, "replicas[0].replica_id"),
        ({"replicas": [{"replica_id": 1, "state": "loading", "running": "2"}]}, "replicas[0].running"),
        ({"replicas": [{"replica_id": 1, "state": "loading", "pid": 0}]}, "replicas[0].pid"),
        ({"replicas": [{"replica_id": 1, "state": "loading", "pid": "4242"}]}, "replicas[0].pid"),
        ({"replicas": [{"replica_id": 1, "state": "loading", "tenant_shares": [0.5]}]}, "replicas[0].tenant_shares"),
        (
            {"replicas": [{"replica_id": 1, "state": "loading", "tenant_shares": {"3": 1.5}}]},
            "replicas[0].tenant_shares.3",
        ),
        (
            {"replicas": [{"replica_id": 1, "state": "loading", "tenant_shares": {str(i): 0.01 for i in range(17)}}]},
            "replicas[0].tenant_shares",
        ),
        ({"replicas": [{"replica_id": 1, "state": "loading"}, {"replica_id": 1, "state": "loading"}]}, "replicas"),
        ({"staging": []}, "staging"),
        ({"staging": {"budget_bytes": -1}}, "staging.budget_bytes"),
        (
            {
                "staging": {
                    "budget_bytes": 1,
                    "models": [{"path": "m", "bytes": 1, "how": "page_cache", "resident_fraction": 1}],
                }
            },
            "staging.models[0].path",
        ),
        (
            {
                "staging": {
                    "budget_bytes": 1,
                    "models": [{"path": "/m", "bytes": 1, "how": "disk", "resident_fraction": 1}],
                }
            },
            "staging.models[0].how",
        ),
        (
            {
                "staging": {
                    "budget_bytes": 1,
                    "models": [{"path": "/m", "bytes": 1, "how": "pinned", "resident_fraction": 1.5}],
                }
            },
            "staging.models[0].resident_fraction",
        ),
    ],
)
def test_bad_heartbeats_name_the_field(body, field):
    assert field == _error_fields(parse_heartbeat, body)


@pytest.mark.parametrize("quantization", [{"/models/elsewhere": "fp8"}, {"/models/a": "int3"}, ["/models/a"]])
def test_a_bad_quantization_report_is_named(quantization):
    body = {"models": {"roots": ["/models"], "paths": ["/models/a"], "quantization": quantization}}
    assert _error_fields(parse_heartbeat, body).startswith("models.quantization")


@pytest.mark.parametrize(
    ("checkpoints", "field"),
    [
        ({"/models/elsewhere": {}}, "models.checkpoints['/models/elsewhere']"),
        ({"/models/a": {"kind": "audio"}}, "models.checkpoints['/models/a'].kind"),
        ({"/models/a": {"parameter_count": 0}}, "models.checkpoints['/models/a'].parameter_count"),
        ({"/models/a": {"context_length": "8k"}}, "models.checkpoints['/models/a'].context_length"),
        ({"/models/a": {"problem": "x" * 1001}}, "models.checkpoints['/models/a'].problem"),
        ({"/models/a": {"repo_id": 7}}, "models.checkpoints['/models/a'].repo_id"),
        (["/models/a"], "models.checkpoints"),
    ],
)
def test_a_bad_checkpoint_report_is_named(checkpoints, field):
    body = {"models": {"roots": ["/models"], "paths": ["/models/a"], "checkpoints": checkpoints}}
    assert _error_fields(parse_heartbeat, body) == field


def test_checkpoint_reports_parse_back():
    report = CheckpointReport(
        repo_id="org/a", architecture="LlamaForCausalLM", family="llama", kind="chat", parameter_count=8
    )
    models = ModelPaths(roots=("/models",), paths=("/models/a", "/models/b"), checkpoints=(("/models/a", report),))
    assert parse_heartbeat({"models": models.to_json()}).models == models


def test_what_the_daemon_builds_the_control_plane_parses_back():
    models = ModelPaths(roots=("/models",), paths=("/models/a", "/models/b"), quantization=(("/models/b", "fp8"),))
    registration = WorkerRegistration(
        name="host-a",
        advertise_host="10.0.0.5",
        device="cuda",
        gpus=(GpuSpec(index=0, name="NVIDIA H200", memory_total_bytes=150 * 10**9),),
        cpu_memory_total_bytes=64 * 2**30,
        cpu_cores=16,
        version="1.0",
        models=models,
    )
    assert parse_registration(registration.to_json()) == registration
    heartbeat = Heartbeat(
        sent_at="2026-12-01T00:00:00+00:00",
        draining=False,
        gpus=({"index": 0, "utilization_pct": 12.0, "memory_used_bytes": 10, "memory_total_bytes": 20},),
        cpu={"utilization_pct": 3.0},
        models=None,
        replicas=(
            ReplicaReport(
                replica_id=7,
                state="ready",
                endpoint_url="http://10.0.0.5:8101",
                error="",
                figures={"load_progress": 1.0, "running": 2, "kv_cache_usage": 0.25},
                pid=4242,
                tenant_shares={"12": 0.75, "": 0.25},
            ),
            ReplicaReport(replica_id=8, state="failed", error="it died"),
        ),
    )
    assert parse_heartbeat(heartbeat.to_json()) == heartbeat
    assert "models" not in heartbeat.to_json()  # sent only when the scan changed
    assert "pid" not in heartbeat.to_json()["replicas"][1]  # no process: nothing an older control plane misreads
    staged = Heartbeat(
        sent_at="",
        draining=False,
        gpus=(),
        cpu={},
        replicas=(),
        staging=Staging(
            budget_bytes=32 * 10**9,
            models=(StagedWeights(path="/models/a", bytes=16 * 10**9, how="page_cache", resident_fraction=0.5),),
        ),
    )
    assert parse_heartbeat(staged.to_json()) == staged


def test_prefix_keys_are_digests_and_bounded():
    from gpuworker.contract.heartbeat import ContractError, ReplicaReport, parse_heartbeat
    from gpuworker.contract.prefix_keys import MAX_REPORTED_PREFIX_KEYS, prefix_key_digest

    digest = prefix_key_digest("a conversation")
    report = ReplicaReport(replica_id=3, state="ready", endpoint_url="http://h:1", prefix_keys=(digest,))
    body = {"gpus": [], "cpu": {}, "replicas": [report.to_json()]}
    assert parse_heartbeat(body).replicas[0].prefix_keys == (digest,)
    for bad, message in [
        (["not a digest"], r"replicas\[0\].prefix_keys\[0\]: Must be a prefix key digest"),
        ("abc", r"replicas\[0\].prefix_keys: Must be a JSON array"),
        ([digest] * (MAX_REPORTED_PREFIX_KEYS + 1), r"At most 256 entries"),
    ]:
        body["replicas"][0]["prefix_keys"] = bad
        with pytest.raises(ContractError, match=message):
            parse_heartbeat(body)
