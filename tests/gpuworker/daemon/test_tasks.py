"""Argument checks of the daemon's Celery tasks (the Celery round trip is in test_agent.py)."""

from __future__ import annotations

import pytest

from gpuworker.daemon.supervisor import LoadRequest
from gpuworker.daemon.tasks import DRAIN_WORKER, LOAD_MODEL, UNLOAD_MODEL, TaskArgumentError, check_arguments

GOOD_LOAD = {"replica_id": 3, "model_path": "/models/m", "served_model_name": "m", "gpu_index": 1,
             "memory_fraction": 0.4}


def test_defaults_are_filled_in_and_make_a_load_request():
    checked = check_arguments(LOAD_MODEL, (), GOOD_LOAD)
    assert LoadRequest(**checked) == LoadRequest(3, "/models/m", "m", 1, 0.4, max_model_len=None, dtype="auto")
    assert check_arguments(UNLOAD_MODEL, (), {"replica_id": 3}) == {"replica_id": 3, "drain_timeout_s": 30.0}
    assert check_arguments(DRAIN_WORKER, (), {}) == {"timeout_s": 60.0}
    assert check_arguments(LOAD_MODEL, (), {**GOOD_LOAD, "gpu_index": None, "memory_fraction": 1})["gpu_index"] is None


@pytest.mark.parametrize("change, message", [
    ({"replica_id": True}, "replica_id must be an integer >= 0, got True"),
    ({"replica_id": -1}, "replica_id must be an integer >= 0, got -1"),
    ({"model_path": ""}, "model_path must be a non-empty string"),
    ({"served_model_name": None}, "served_model_name must be a non-empty string"),
    ({"gpu_index": 0.5}, "gpu_index must be an integer >= 0 or null, got 0.5"),
    ({"memory_fraction": 0}, "memory_fraction must be a number in (0, 1], got 0"),
    ({"max_model_len": 0}, "max_model_len must be an integer >= 1 or null, got 0"),
    ({"dtype": "int8"}, "dtype must be one of auto, float32, float16, bfloat16, got 'int8'"),
])
def test_bad_load_arguments_name_the_field_and_the_limit(change, message):
    with pytest.raises(TaskArgumentError) as error:
        check_arguments(LOAD_MODEL, (), {**GOOD_LOAD, **change})
    assert str(error.value).startswith(message)


def test_missing_extra_and_positional_arguments_are_refused():
    with pytest.raises(TaskArgumentError, match="^gpu_index is required$"):
        check_arguments(LOAD_MODEL, (), {k: v for k, v in GOOD_LOAD.items() if k != "gpu_index"})
    with pytest.raises(TaskArgumentError, match=r"^unexpected argument\(s\) force"):
        check_arguments(UNLOAD_MODEL, (), {"replica_id": 1, "force": True})
    with pytest.raises(TaskArgumentError, match="keyword arguments only"):
        check_arguments(DRAIN_WORKER, (10,), {})
    with pytest.raises(TaskArgumentError, match=r"timeout_s must be a number in \[0, 3600\], got 7200"):
        check_arguments(DRAIN_WORKER, (), {"timeout_s": 7200})
