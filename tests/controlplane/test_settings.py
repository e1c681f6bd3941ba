"""Settings come from the environment; production variables pass `manage.py check --deploy`."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane import integrations
from controlplane.env import env_bool, env_decimal, env_float, env_int, env_list, read_env_file

REPO = Path(__file__).resolve().parents[2]
# Variables the test environment may carry that would change what is being checked.
_ISOLATE = (
    "DEBUG",
    "SECRET_KEY",
    "ALLOWED_HOSTS",
    "CSRF_TRUSTED_ORIGINS",
    "SECURE_SSL_REDIRECT",
    "SESSION_COOKIE_SECURE",
    "CSRF_COOKIE_SECURE",
    "SECURE_HSTS_SECONDS",
    "SECURE_HSTS_INCLUDE_SUBDOMAINS",
    "SECURE_HSTS_PRELOAD",
    "SECURE_PROXY_SSL_HEADER",
    "TRUSTED_PROXIES",
)


def _manage(*args, env, tmp_path):
    clean = {k: v for k, v in os.environ.items() if k not in _ISOLATE}
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env={**clean, "VAR_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": secrets.token_urlsafe(50),
    "ALLOWED_HOSTS": "gpuserve.example.com",
    "CSRF_TRUSTED_ORIGINS": "https://gpuserve.example.com",
    "SECURE_PROXY_SSL_HEADER": "1",
    "SECURE_HSTS_PRELOAD": "1",
    "GPUSERVE_WORKER_TOKEN": secrets.token_urlsafe(32),
}


def test_check_deploy_passes_with_production_variables(tmp_path):
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env=PRODUCTION, tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues" in result.stdout


def test_check_deploy_fails_with_development_defaults(tmp_path):
    result = _manage("check", "--deploy", "--fail-level", "WARNING", env={"DEBUG": "1"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "security.W018" in result.stderr  # DEBUG on in deployment


def test_secret_key_is_required_when_debug_is_off(tmp_path):
    env = {k: v for k, v in PRODUCTION.items() if k != "SECRET_KEY"}
    result = _manage("check", env=env, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_worker_token_is_required_when_debug_is_off(tmp_path):
    env = {k: v for k, v in PRODUCTION.items() if k != "GPUSERVE_WORKER_TOKEN"}
    result = _manage("check", env=env, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "GPUSERVE_WORKER_TOKEN must be set when DEBUG is off" in result.stderr


def test_debug_without_a_worker_token_shares_one_through_a_private_file(tmp_path):
    script = "from django.conf import settings; print(settings.FLEET_WORKER_TOKEN)"
    tokens = {_manage("shell", "-c", script, env={"DEBUG": "1"}, tmp_path=tmp_path).stdout.strip() for _ in range(2)}
    assert len(tokens) == 1 and len(tokens.pop()) >= 40
    assert (tmp_path / "worker-token").stat().st_mode & 0o077 == 0


def test_bad_boolean_names_the_variable(tmp_path):
    result = _manage("check", env={"DEBUG": "maybe"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "DEBUG must be one of" in result.stderr


def test_a_bad_trusted_proxies_value_stops_the_start(tmp_path):
    result = _manage("check", env={"TRUSTED_PROXIES": "*"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "TRUSTED_PROXIES lists addresses or networks; '*' would trust every client" in result.stderr


def test_autoscaling_settings_out_of_bounds_name_the_variable(tmp_path):
    result = _manage("check", env={"AUTOSCALE_HYSTERESIS_PERCENT": "150"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "AUTOSCALE_HYSTERESIS_PERCENT must lie between 0 and 99; got 150." in result.stderr


@pytest.mark.parametrize(
    ("raw", "expected"), [("1", True), ("yes", True), ("ON", True), ("0", False), ("off", False), ("", False)]
)
def test_env_bool(monkeypatch, raw, expected):
    monkeypatch.setenv("FLAG", raw)
    assert env_bool("FLAG", not expected) is expected


def test_env_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("UNSET_VAR", raising=False)
    assert env_bool("UNSET_VAR", True) is True
    assert env_int("UNSET_VAR", 7) == 7
    assert env_list("UNSET_VAR", ["a"]) == ["a"]
    monkeypatch.setenv("NUM", "ten")
    with pytest.raises(ImproperlyConfigured, match="NUM must be an integer"):
        env_int("NUM", 1)
    monkeypatch.setenv("HOSTS", " a.example , ,b.example ")
    assert env_list("HOSTS", []) == ["a.example", "b.example"]


@pytest.mark.parametrize("raw", ["two dollars", "-1", "NaN", "Infinity"])
def test_env_decimal_refuses_what_is_not_an_amount(monkeypatch, raw):
    monkeypatch.setenv("GPU_HOUR_COST_USD", raw)
    with pytest.raises(ImproperlyConfigured, match="GPU_HOUR_COST_USD must be"):
        env_decimal("GPU_HOUR_COST_USD", "2.00")


def test_env_decimal_reads_an_amount_or_the_default(monkeypatch):
    monkeypatch.setenv("GPU_HOUR_COST_USD", " 3.25 ")
    assert str(env_decimal("GPU_HOUR_COST_USD", "2.00")) == "3.25"
    monkeypatch.setenv("GPU_HOUR_COST_USD", "")
    assert str(env_decimal("GPU_HOUR_COST_USD", "2.00")) == "2.00"


def test_read_env_file(tmp_path):
    path = tmp_path / ".env"
    path.write_text("# comment\n\nA=1\nB = two=2 \nnot a pair\n")
    assert read_env_file(path) == {"A": "1", "B": "two=2"}
    assert read_env_file(tmp_path / "missing") == {}


def test_embedded_defaults_need_no_server(tmp_path):
    database = integrations.database("", tmp_path)
    assert database["ENGINE"] == "django.db.backends.sqlite3"
    assert database["NAME"] == str(tmp_path / "db.sqlite3")
    assert integrations.caches("")["default"]["BACKEND"].endswith("LocMemCache")
    layer = integrations.channel_layers("", relay_port=8123)["default"]
    assert layer["BACKEND"] == "controlplane.live_relay.RelayedInMemoryChannelLayer"
    assert layer["CONFIG"] == {"relay_port": 8123}
    broker, options = integrations.celery_broker("", tmp_path)
    assert broker == f"sqlite:///{tmp_path / 'celery' / 'broker.sqlite3'}" and options == {}
    assert (tmp_path / "celery").is_dir()
    # Nothing reads a task's result: the embedded set-up keeps none.
    assert integrations.celery_result_backend("") is None


def test_urls_switch_to_postgresql_and_redis(tmp_path):
    database = integrations.database("postgres://u:p@db.internal:5432/gpuserve", tmp_path)
    assert (database["ENGINE"], database["HOST"], database["NAME"]) == (
        "django.db.backends.postgresql",
        "db.internal",
        "gpuserve",
    )
    redis = "redis://cache.internal:6379/2"
    assert integrations.caches(redis)["default"]["LOCATION"] == redis
    assert integrations.channel_layers(redis)["default"]["CONFIG"]["hosts"] == [
        {"address": redis, "socket_timeout": None}
    ]
    assert integrations.celery_broker(redis, tmp_path) == (redis, {})
    assert integrations.celery_result_backend(redis) == redis


@pytest.mark.parametrize("raw", ["soon", "-0.5", "nan", "inf"])
def test_env_float_refuses_what_is_not_a_number_of_seconds(monkeypatch, raw):
    monkeypatch.setenv("GATEWAY_REFUSAL_FLUSH_SECONDS", raw)
    with pytest.raises(ImproperlyConfigured, match="GATEWAY_REFUSAL_FLUSH_SECONDS must be"):
        env_float("GATEWAY_REFUSAL_FLUSH_SECONDS", 5.0)


def test_env_float_reads_a_fraction_or_the_default(monkeypatch):
    monkeypatch.setenv("GATEWAY_REFUSAL_FLUSH_SECONDS", " 0.2 ")
    assert env_float("GATEWAY_REFUSAL_FLUSH_SECONDS", 5.0) == 0.2
    monkeypatch.setenv("GATEWAY_REFUSAL_FLUSH_SECONDS", "")
    assert env_float("GATEWAY_REFUSAL_FLUSH_SECONDS", 5.0) == 5.0
