"""docker-compose.yml is a valid production stack (checked with `docker-compose config`; no
engine is needed, so this runs wherever the docker-compose binary is installed)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE = shutil.which("docker-compose")
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="docker-compose is not installed")

PRODUCTION = {
    "SECRET_KEY": "k" * 60,
    "POSTGRES_PASSWORD": "pw",
    "PUBLIC_HOST": "gpuserve.example.com",
    "GPUSERVE_WORKER_TOKEN": "w" * 43,
}


def _config(*args, env):
    clean = {k: v for k, v in os.environ.items() if k not in PRODUCTION}
    return subprocess.run(
        [COMPOSE, "-f", str(REPO / "docker-compose.yml"), "config", *args],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_config_accepts_the_file():
    result = _config(env=PRODUCTION)
    assert result.returncode == 0, result.stderr
    services = _config("--services", env=PRODUCTION).stdout.split()
    assert {"postgres", "redis", "web", "fleet", "celery-worker", "beat", "gpuworker"} <= set(services)
    rendered = result.stdout
    assert "driver: nvidia" in rendered and "- gpu" in rendered  # the GPU is reserved
    # Every service but the GPU worker daemon, which serves no port (heartbeats show its health).
    assert rendered.count("healthcheck:") >= 6
    for volume in ("pgdata:", "models:"):
        assert volume in rendered


def test_compose_refuses_to_start_without_secrets():
    result = _config(env={})
    assert result.returncode != 0
    assert "SECRET_KEY" in result.stderr or "POSTGRES_PASSWORD" in result.stderr
    result = _config(env={k: v for k, v in PRODUCTION.items() if k != "GPUSERVE_WORKER_TOKEN"})
    assert result.returncode != 0 and "GPUSERVE_WORKER_TOKEN" in result.stderr


def test_the_gpu_worker_runs_the_daemon_against_the_fleet_server():
    import yaml

    services = yaml.safe_load(_config(env=PRODUCTION).stdout)["services"]
    daemon = services["gpuworker"]["command"]
    assert "daemon" in daemon and daemon[daemon.index("--control-url") + 1] == "http://fleet:8001"
    # The fleet server serves only the daemons' routes, apart from the web server's tenant traffic.
    fleet = services["fleet"]["command"]
    assert "controlplane.fleet_asgi:application" in fleet and fleet[fleet.index("--port") + 1] == "8001"
    assert "fleet" in services["fleet"]["environment"]["ALLOWED_HOSTS"].split(",")
    assert "fleet" in services["gpuworker"]["depends_on"]


def test_the_web_processes_share_a_fresh_metrics_directory():
    import yaml

    services = yaml.safe_load(_config(env={**PRODUCTION, "METRICS_TOKEN": "m" * 40}).stdout)["services"]
    web = services["web"]
    assert web["environment"]["PROMETHEUS_MULTIPROC_DIR"] == "/run/gpuserve-metrics"
    assert "/run/gpuserve-metrics" in web["tmpfs"]
    assert web["environment"]["METRICS_TOKEN"] == "m" * 40
    assert web["environment"]["DATABASE_URL"].startswith("postgres://")  # the shared settings are kept
    # Only the web processes write metric files: the GPU worker's replicas keep theirs in memory.
    assert "PROMETHEUS_MULTIPROC_DIR" not in services["gpuworker"].get("environment", {})


def test_web_believes_x_forwarded_for_only_from_the_hosts_proxy():
    import yaml

    rendered = yaml.safe_load(_config(env=PRODUCTION).stdout)
    web = rendered["services"]["web"]
    # uvicorn's own proxy-header handling is off (it would believe anyone it was told to);
    # the control plane's TRUSTED_PROXIES decides, and names only this network's gateway, where a
    # proxy on the host appears.
    assert "--no-proxy-headers" in web["command"] and "--forwarded-allow-ips" not in web["command"]
    gateway = rendered["networks"]["default"]["ipam"]["config"][0]["gateway"]
    assert web["environment"]["TRUSTED_PROXIES"] == gateway
    # An operator with nothing in front sets it empty, and empty stays empty (nobody trusted).
    emptied = yaml.safe_load(_config(env={**PRODUCTION, "TRUSTED_PROXIES": ""}).stdout)
    assert emptied["services"]["web"]["environment"]["TRUSTED_PROXIES"] in ("", None)
