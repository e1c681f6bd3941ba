"""The scheduler stamps a request's first scheduling (for the queue-time metric) once, never again."""

from __future__ import annotations

import time

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.scheduler import Scheduler
from gpuworker.engine.sequence import SequenceGroup


def test_first_scheduled_time_is_set_at_admission_and_kept():
    config = EngineConfig(
        model="unused", block_size=4, num_kv_blocks=8, max_model_len=16, max_num_batched_tokens=16, max_num_seqs=1
    )
    scheduler = Scheduler(config)
    first = SequenceGroup("a", [1, 2, 3], SamplingParams(max_tokens=4), 0, 4, first_seq_id=0)
    second = SequenceGroup("b", [4, 5, 6], SamplingParams(max_tokens=4), 1, 4, first_seq_id=1)
    scheduler.add(first)
    scheduler.add(second)
    before = time.time()
    batch = scheduler.schedule()
    after = time.time()
    assert [entry.seq.group for entry in batch.seqs] == [first]  # max_num_seqs=1: b keeps waiting
    assert before <= first.first_scheduled_time <= after and second.first_scheduled_time is None
    stamped = first.first_scheduled_time
    scheduler.postprocess(batch, [7])
    scheduler.schedule()
    assert first.first_scheduled_time == stamped
    scheduler.finish(first.seqs[0], "length")
    scheduler.schedule()
    assert second.first_scheduled_time is not None and second.first_scheduled_time >= stamped
