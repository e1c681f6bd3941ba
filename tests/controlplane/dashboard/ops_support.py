"""Helpers for the operator-page tests: users by role, a private live cache per test, uniquely
named workers (their Celery queues must not meet another run's on the shared broker), and a
worker's latest heartbeat stored through the real heartbeat service."""

import uuid

import pytest
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.fleet.services.heartbeats import worker_heartbeat
from gpuworker.contract.heartbeat import parse_heartbeat
from tests.controlplane.factories import TenantFactory, UserFactory, WorkerFactory


@pytest.fixture(autouse=True)
def _private_live_cache(settings):
    settings.CACHES = {**settings.CACHES, "live": {**settings.CACHES["live"], "KEY_PREFIX": f"test-{uuid.uuid4().hex}"}}


def make_user(role: str) -> User:
    tenant = TenantFactory() if role == User.Role.TENANT_MEMBER else None
    return UserFactory(role=role, tenant=tenant)


@pytest.fixture
def operator() -> User:
    return make_user(User.Role.OPERATOR)


@pytest.fixture
def operator_client(client, operator):
    client.force_login(operator)
    return client


def make_worker(**fields):
    return WorkerFactory(name=fields.pop("name", f"test-{uuid.uuid4().hex[:12]}"), **fields)


def beat(worker, *, gpus=(), cpu=None, replicas=(), now=None) -> None:
    """One heartbeat through the service the /internal/ endpoint calls, received at `now`."""
    body = {
        "gpus": list(gpus),
        "cpu": cpu or {"utilization_pct": 5.0, "memory_used_bytes": 1 << 30, "memory_total_bytes": 8 << 30},
        "replicas": list(replicas),
    }
    worker_heartbeat(worker_id=worker.pk, heartbeat=parse_heartbeat(body), now=now or timezone.now())


def cpu_agent(*, control_url: str, token: str, name: str, model_root, state_dir):
    """A CPU worker daemon's agent for `control_url` with `model_root` its one model root, not yet
    registered (the test calls its _register, as the daemon does at start, and closes it)."""
    from gpuworker.contract.heartbeat import WorkerRegistration
    from gpuworker.daemon.agent import Agent, AgentConfig
    from gpuworker.daemon.hardware import HardwareProbe

    agent = Agent(
        AgentConfig(
            control_url=control_url,
            token=token,
            name=name,
            advertise_host="127.0.0.1",
            device="cpu",
            state_dir=state_dir,
            model_roots=(model_root,),
        )
    )
    agent.probe = HardwareProbe("cpu")
    agent._registration = WorkerRegistration(
        name=name,
        advertise_host="127.0.0.1",
        device="cpu",
        gpus=(),
        cpu_memory_total_bytes=2**30,
        cpu_cores=2,
        version="test",
    )
    return agent
