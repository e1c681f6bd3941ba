"""The daemon's Celery tasks: names and argument checks, the same for the control plane that builds a
task and the daemon that receives one (the Celery round trip is in daemon/test_agent.py)."""

from __future__ import annotations

import pytest

from gpuworker.contract.tasks import (
    DRAIN_WORKER,
    LOAD_MODEL,
    LOAD_QUANTIZATIONS,
    UNLOAD_MODEL,
    DrainWorker,
    LoadModel,
    TaskArgumentError,
    UnloadModel,
    parse_task,
)

GOOD_LOAD = {
    "replica_id": 3,
    "model_path": "/models/m",
    "served_model_name": "m",
    "gpu_index": 1,
    "memory_fraction": 0.4,
}


def test_defaults_are_filled_in():
    assert parse_task(LOAD_MODEL, (), GOOD_LOAD) == LoadModel(
        3,
        "/models/m",
        "m",
        1,
        0.4,
        max_model_len=None,
        allow_long_context=False,
        dtype="auto",
        tensor_parallel_size=1,
        expert_parallel="all_reduce",
        quantization="",
    )
    assert parse_task(UNLOAD_MODEL, (), {"replica_id": 3}).as_kwargs() == {"replica_id": 3, "drain_timeout_s": 30.0}
    assert parse_task(DRAIN_WORKER, (), {}) == DrainWorker(timeout_s=60.0)
    assert parse_task(LOAD_MODEL, (), {**GOOD_LOAD, "gpu_index": None, "memory_fraction": 1}).gpu_index is None


def test_what_the_sender_builds_the_receiver_parses_back():
    for task in (
        LoadModel(**GOOD_LOAD, max_model_len=2048, dtype="bfloat16", tensor_parallel_size=2),
        LoadModel(**GOOD_LOAD, tensor_parallel_size=2, expert_parallel="all_to_all"),
        LoadModel(**GOOD_LOAD, quantization="fp8"),
        LoadModel(**GOOD_LOAD, max_model_len=131072, allow_long_context=True),
        UnloadModel(replica_id=9),
        DrainWorker(timeout_s=5),
    ):
        assert parse_task(task.NAME, (), task.as_kwargs()) == task


@pytest.mark.parametrize(
    "change, message",
    [
        ({"replica_id": True}, "replica_id must be an integer >= 0, got True"),
        ({"replica_id": -1}, "replica_id must be an integer >= 0, got -1"),
        ({"model_path": ""}, "model_path must be a non-empty string"),
        ({"served_model_name": None}, "served_model_name must be a non-empty string"),
        ({"gpu_index": 0.5}, "gpu_index must be an integer >= 0 or null, got 0.5"),
        ({"memory_fraction": 0}, "memory_fraction must be a number in (0, 1], got 0"),
        ({"max_model_len": 0}, "max_model_len must be an integer in [1, 4194304] or null, got 0"),
        ({"max_model_len": 4194305}, "max_model_len must be an integer in [1, 4194304] or null, got 4194305"),
        ({"allow_long_context": "yes"}, "allow_long_context must be true or false, got 'yes'"),
        ({"dtype": "int8"}, "dtype must be one of auto, float32, float16, bfloat16, got 'int8'"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        ({"expert_parallel": "alltoall"}, "expert_parallel must be one of all_reduce, all_to_all, got 'alltoall'"),
        ({"quantization": "int4"}, "quantization must be one of '', 'fp8', got 'int4'"),
        ({"quantization": None}, "quantization must be one of '', 'fp8', got None"),
    ],
)
def test_bad_load_arguments_name_the_field_and_the_limit(change, message):
    with pytest.raises(TaskArgumentError) as error:
        parse_task(LOAD_MODEL, (), {**GOOD_LOAD, **change})
    assert str(error.value).startswith(message)
    with pytest.raises(TaskArgumentError) as error:  # the sender's side fails the same way
        LoadModel(**{**GOOD_LOAD, **change})
    assert str(error.value).startswith(message)


def test_missing_extra_and_positional_arguments_are_refused():
    with pytest.raises(TaskArgumentError, match="^gpu_index is required$"):
        parse_task(LOAD_MODEL, (), {k: v for k, v in GOOD_LOAD.items() if k != "gpu_index"})
    with pytest.raises(TaskArgumentError, match=r"^unexpected argument\(s\) force"):
        parse_task(UNLOAD_MODEL, (), {"replica_id": 1, "force": True})
    with pytest.raises(TaskArgumentError, match="keyword arguments only"):
        parse_task(DRAIN_WORKER, (10,), {})
    with pytest.raises(TaskArgumentError, match=r"timeout_s must be a number in \[0, 3600\], got 7200"):
        parse_task(DRAIN_WORKER, (), {"timeout_s": 7200})


def test_stage_weights_round_trips_and_checks_its_list():
    from gpuworker.contract.tasks import STAGE_WEIGHTS, StageWeights

    task = StageWeights(model_paths=["/models/a", "/models/b"])
    assert task.as_kwargs() == {"model_paths": ["/models/a", "/models/b"]}
    assert parse_task(STAGE_WEIGHTS, (), task.as_kwargs()) == task
    assert parse_task(STAGE_WEIGHTS, (), {"model_paths": []}).model_paths == ()
    for bad in ("/models/a", ["/models/a", "/models/a"], [""], [3], ["/m"] * 65):
        with pytest.raises(TaskArgumentError, match="model_paths"):
            parse_task(STAGE_WEIGHTS, (), {"model_paths": bad})


def test_the_load_quantizations_are_the_engines():
    from gpuworker.checkpoint_quantization import LOAD_QUANTIZATIONS as ENGINE_LOAD_QUANTIZATIONS

    assert LOAD_QUANTIZATIONS == tuple(q or "" for q in ENGINE_LOAD_QUANTIZATIONS)
