"""The fleet simulator (bench/fleet_sim.py) on a tiny trace: every request is served or counted as
failed, GPU time is counted, a seed gives the same run, and the real router and autoscaler act."""

from collections import Counter
from dataclasses import replace

from bench.fleet_model import Trace, TraceShape, decode_step_s
from bench.fleet_sim import FleetParams, Simulation, run_scenarios, summarise

SHAPE = TraceShape(models=4, peak_requests_per_s=6.0, day_s=900.0, bursts=1, burst_s=60.0, think_mean_s=5.0)
DURATION_S = 900.0
DEFAULT_PARAMS = FleetParams()


# Sparse traffic: models go idle long enough to scale to zero.
SPARSE = replace(SHAPE, peak_requests_per_s=0.4, bursts=0)


def _run(
    params: FleetParams = DEFAULT_PARAMS,
    *,
    affinity: bool = True,
    static: dict | None = None,
    seed: int = 1,
    shape: TraceShape = SHAPE,
):
    return Simulation("t", Trace(shape, seed, DURATION_S), params, affinity=affinity, static=static).run()


def _accounted(result) -> None:
    assert result.requests
    for request in result.requests:
        if request.failed:
            assert request.first_token_at is None and request.finished_at is not None
        else:
            assert request.arrival <= request.first_token_at <= request.finished_at


def test_every_request_is_served_or_failed_and_gpu_time_counted():
    result = _run()
    _accounted(result)
    assert not any(r.failed for r in result.requests)
    assert result.gpu_hours > 0
    assert sum(result.decisions.values()) > 0  # the autoscaler decided every tick


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    def fingerprint(result):
        return [(r.model, r.turn, r.arrival, r.first_token_at, r.replica_id) for r in result.requests], result.gpu_hours

    assert fingerprint(_run(seed=3)) == fingerprint(_run(seed=3))
    assert fingerprint(_run(seed=3)) != fingerprint(_run(seed=4))


def test_a_cold_start_slower_than_the_gateway_waits_fails_its_requests():
    # Models scale to zero after 30 s idle; a reload takes longer than a request may wait for one.
    policy = replace(FleetParams.policy, idle_to_zero_s=30.0)
    slow = _run(
        replace(FleetParams(), policy=policy, staged_models=0, load_cold_s=120.0, cold_wait_s=60.0, popular_top_k=0),
        shape=SPARSE,
    )
    _accounted(slow)
    assert any(r.failed for r in slow.requests)
    fast = _run(
        replace(FleetParams(), policy=policy, staged_models=0, load_cold_s=5.0, cold_wait_s=60.0, popular_top_k=0),
        shape=SPARSE,
    )
    _accounted(fast)
    cold = [r for r in fast.requests if r.cold]
    assert cold and not any(r.failed for r in fast.requests)
    assert max(r.ttft for r in cold) >= 5.0  # the first of a cold start waits for the whole load


def test_popular_models_are_kept_warm():
    policy = replace(FleetParams.policy, idle_to_zero_s=30.0)
    alone = _run(replace(FleetParams(), policy=policy, popular_top_k=0), shape=SPARSE)
    kept = _run(replace(FleetParams(), policy=policy, popular_top_k=4), shape=SPARSE)
    assert sum(r.cold for r in kept.requests) < sum(r.cold for r in alone.requests)


def _same_replica_share(result) -> float:
    """The share of later turns sent to the replica that served their conversation's previous turn."""
    previous, same, later = {}, 0, 0
    for request in sorted(result.requests, key=lambda r: (r.conversation.id, r.turn)):
        if request.turn > 0 and request.replica_id is not None:
            later += 1
            same += previous.get(request.conversation.id) == request.replica_id
        previous[request.conversation.id] = request.replica_id
    return same / later


def test_prefix_affinity_keeps_conversations_on_their_replica_and_makes_later_turns_cheaper():
    static = {m: 3 for m in range(SHAPE.models)}
    by_affinity, round_robin = _run(affinity=True, static=static), _run(affinity=False, static=static)
    assert _same_replica_share(by_affinity) > 2 * _same_replica_share(round_robin)
    by_affinity, round_robin = summarise(by_affinity, [0], 2.0), summarise(round_robin, [0], 2.0)
    assert by_affinity["later_turns_ttft_mean_s"] < round_robin["later_turns_ttft_mean_s"]
    for summary in (by_affinity, round_robin):  # held from the start to the last answer
        assert summary["gpu_hours"] >= 3 * SHAPE.models * DURATION_S / 3600


def test_scenarios_share_one_trace_and_static_holds_the_autoscaled_peak():
    results = run_scenarios(SHAPE, FleetParams(), 2, DURATION_S, ("autoscaled", "static-peak"))
    auto, static = results
    assert sorted(r.arrival for r in auto.requests if r.turn == 0) == sorted(
        r.arrival for r in static.requests if r.turn == 0
    )
    assert static.peak_replicas == {m: max(1, auto.peak_replicas.get(m, 0)) for m in range(SHAPE.models)}


def test_decode_steps_follow_the_measured_curve():
    assert decode_step_s(1) == 4.17e-3 and decode_step_s(96) == 9.8e-3
    assert decode_step_s(1) < decode_step_s(64) < decode_step_s(256) < decode_step_s(600)


def test_conversations_behind_a_long_system_prompt_spread_over_replicas_and_keep_theirs():
    # The router keys on each request's OpenAI-style body as the gateway does (affinity_key): a
    # 1,200-character system prompt must not send all of a model's conversations to one replica.
    shape = replace(SHAPE, system_prompt_chars=1200)
    static = {m: 3 for m in range(SHAPE.models)}
    by_affinity = _run(static=static, shape=shape)
    for model in range(SHAPE.models):
        firsts = Counter(r.replica_id for r in by_affinity.requests if r.model == model and r.turn == 0)
        assert len(firsts) == 3 and max(firsts.values()) < 0.6 * sum(firsts.values())
    assert _same_replica_share(by_affinity) > 2 * _same_replica_share(_run(affinity=False, static=static, shape=shape))
