import pytest

from controlplane.fleet.heartbeat import RecordedReplica, Step, plan_heartbeat
from gpuworker.contract.heartbeat import ReplicaReport

URL = "http://127.0.0.1:8101"


def _plan(recorded_state, reported_state, **report):
    recorded = [RecordedReplica(1, recorded_state)] if recorded_state else []
    reported = [ReplicaReport(1, reported_state, **report)] if reported_state else []
    return plan_heartbeat(recorded=recorded, reported=reported)


@pytest.mark.parametrize(
    ("recorded", "reported", "path"),
    [
        ("pending", "loading", ("loading",)),
        ("pending", "ready", ("loading", "ready")),
        ("loading", "ready", ("ready",)),
        ("ready", "draining", ("draining",)),
        ("ready", "stopped", ("draining", "stopped")),
        ("draining", "stopped", ("stopped",)),
        ("pending", "stopped", ("stopped",)),
    ],
)
def test_reports_walk_the_state_machine(recorded, reported, path):
    plan = _plan(recorded, reported, endpoint_url=URL if reported == "ready" else "")
    assert [step.path for step in plan.steps] == [path] and plan.unload == []


@pytest.mark.parametrize(
    ("recorded", "reported"),
    [
        ("loading", "loading"),
        ("ready", "ready"),
        ("draining", "draining"),
        ("stopped", "stopped"),
        ("failed", "failed"),
        ("stopped", "draining"),
        ("failed", "draining"),
    ],
)
def test_steady_state_plans_nothing(recorded, reported):
    plan = _plan(recorded, reported, endpoint_url=URL)
    assert plan.steps == [] and plan.unload == []


def test_a_failed_load_is_a_load_failure_and_a_crash_after_ready_is_not():
    assert _plan("loading", "failed", error="model path /x does not exist").steps == [
        Step(1, ("failed",), error="model path /x does not exist", failure="load")
    ]
    assert _plan("ready", "failed", error="exit 1").steps[0].failure == "crashed"


@pytest.mark.parametrize("recorded", ["draining", "stopped", "failed"])
def test_replicas_the_control_plane_wants_gone_are_unloaded(recorded):
    assert _plan(recorded, "ready", endpoint_url=URL).unload == [1]


def test_unknown_replicas_are_unloaded_unless_already_going():
    assert _plan(None, "ready", endpoint_url=URL).unload == [1]
    assert _plan(None, "loading").unload == [1]
    assert _plan(None, "draining").unload == []


def test_replicas_the_worker_forgot():
    assert _plan("ready", None).steps[0].failure == "vanished"
    assert _plan("draining", None).steps == [Step(1, ("stopped",))]
    # The load message may still be on its way: left to the acknowledgement timeout.
    assert _plan("pending", None).steps == []
