import ast
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.fleet import autoscaling
from controlplane.fleet.autoscaling import AutoscalePolicy, DeploymentSignals, ReplicaLoad, decide, popular

NOW = 1_000_000.0

POLICY = AutoscalePolicy(
    min_replicas=0,
    max_replicas=4,
    keep_warm=False,
    target_concurrency=4.0,
    target_utilisation=0.7,
    hysteresis=0.2,
    ttft_slo_s=1.0,
    itl_slo_s=0.1,
    kv_cache_high=0.9,
    scale_up_cooldown_s=30.0,
    scale_down_cooldown_s=300.0,
    idle_to_zero_s=600.0,
)


def _load(running=0.0, waiting=0.0, kv=0.1, ttft=None, itl=None):
    return ReplicaLoad(running=running, waiting=waiting, kv_cache_usage=kv, ttft_p95_s=ttft, itl_p95_s=itl)


def _signals(*loads, current=None, rate=1.0, last_request_ago=1.0, last_scaled_ago=10_000.0, popular=False, queued=0):
    return DeploymentSignals(
        now=NOW,
        current_replicas=len(loads) if current is None else current,
        loads=tuple(loads),
        request_rate_per_s=rate,
        last_request_at=None if last_request_ago is None else NOW - last_request_ago,
        last_scaled_at=None if last_scaled_ago is None else NOW - last_scaled_ago,
        popular=popular,
        queued_cold_starts=queued,
    )


def test_scales_up_on_queue_to_the_replicas_the_demand_needs():
    # 2 replicas with 8 running + 6 waiting each: 28 in flight, 28 / (4 × 0.7) = 10 → capped at 4.
    decision = decide(POLICY, _signals(_load(8, 6), _load(8, 6)))
    assert (decision.action, decision.desired) == ("up", 4)
    assert "utilisation" in decision.reason
    assert decision.inputs["waiting"] == 12 and decision.inputs["utilisation"] == 3.5


def test_scales_up_by_one_on_a_ttft_slo_breach_with_little_queue():
    decision = decide(POLICY, _signals(_load(2, 0, ttft=1.5), _load(2, 0, ttft=0.2)))
    assert (decision.action, decision.desired) == ("up", 3)
    assert "TTFT p95 1.50 s above the 1.00 s SLO" in decision.reason
    assert decision.inputs["ttft_p95_s"] == 1.5


def test_scales_up_on_an_inter_token_latency_breach():
    decision = decide(POLICY, _signals(_load(2, 0, itl=0.25)))
    assert (decision.action, decision.desired) == ("up", 2)
    assert "inter-token p95 250 ms" in decision.reason


def test_scales_up_when_the_kv_cache_is_saturated():
    decision = decide(POLICY, _signals(_load(2, 0, kv=0.95)))
    assert (decision.action, decision.desired) == ("up", 2)
    assert "KV cache 95% full" in decision.reason


def test_stale_latency_on_an_idle_replica_does_not_scale_up():
    decision = decide(POLICY, _signals(_load(0, 0, ttft=5.0), rate=0.0, last_request_ago=60))
    assert decision.action == "hold"


def test_hysteresis_holds_inside_the_band():
    # Target 0.7 × 4 = 2.8 per replica; the band is 56%..84% utilisation.
    for in_flight in (2.3, 2.8, 3.3):
        decision = decide(POLICY, _signals(_load(in_flight), _load(in_flight)))
        assert (decision.action, decision.desired) == ("hold", 2), in_flight
        assert "within" in decision.reason
    assert decide(POLICY, _signals(_load(3.5), _load(3.5))).action == "up"
    assert decide(POLICY, _signals(_load(1.0), _load(1.0))).action == "down"
    # Below the band, but one replica would run above the target: hold rather than flap.
    held = decide(POLICY, _signals(_load(2.0), _load(2.0)))
    assert (held.action, held.desired) == ("hold", 2)
    assert "fewer replicas would run above the target" in held.reason


def test_scales_down_to_what_the_demand_needs_but_keeps_one_while_requests_come():
    decision = decide(POLICY, _signals(_load(1), _load(0), _load(0), _load(0)))
    assert (decision.action, decision.desired) == ("down", 1)
    decision = decide(POLICY, _signals(_load(0)))
    assert decision.action == "hold"


def test_cooldowns_hold_each_direction():
    busy = (_load(8, 6), _load(8, 6))
    held = decide(POLICY, _signals(*busy, last_scaled_ago=10))
    assert (held.action, held.desired) == ("hold", 2)
    assert "cooling down" in held.reason and held.inputs["since_scaled_s"] == 10
    assert decide(POLICY, _signals(*busy, last_scaled_ago=31)).action == "up"
    quiet = (_load(0), _load(0), _load(0))
    assert decide(POLICY, _signals(*quiet, last_scaled_ago=100)).action == "hold"
    assert decide(POLICY, _signals(*quiet, last_scaled_ago=301)).action == "down"


def test_bounds_cap_scale_up_and_bring_counts_inside():
    at_max = decide(replace(POLICY, max_replicas=2), _signals(_load(8, 6), _load(8, 6)))
    assert (at_max.action, at_max.desired) == ("hold", 2)
    assert "maximum of 2" in at_max.reason
    above = decide(replace(POLICY, max_replicas=1), _signals(_load(0), _load(0), last_scaled_ago=1))
    assert (above.action, above.desired) == ("down", 1)
    below = decide(replace(POLICY, min_replicas=3), _signals(_load(0), last_scaled_ago=1))
    assert (below.action, below.desired) == ("up", 3)
    assert "minimum of 3" in below.reason


def test_loading_replicas_count_before_adding_more():
    decision = decide(POLICY, _signals(_load(3.5), current=2))
    assert (decision.action, decision.desired) == ("hold", 2)
    assert "still loading" in decision.reason
    assert decide(POLICY, _signals(current=1)).reason == "waiting for a replica to become ready"


def test_scales_to_zero_after_the_idle_period():
    idle = _signals(_load(0), rate=0.0, last_request_ago=601)
    decision = decide(POLICY, idle)
    assert (decision.action, decision.desired) == ("down", 0)
    assert "idle for 10 min" in decision.reason
    assert decide(POLICY, replace(idle, last_request_at=NOW - 599)).action == "hold"
    # A recent scaling event restarts the idle clock, and 0 turns scale-to-zero off.
    assert decide(POLICY, replace(idle, last_scaled_at=NOW - 60)).action == "hold"
    assert decide(replace(POLICY, idle_to_zero_s=0), idle).action == "hold"


def test_replicas_still_working_are_not_idle_even_without_counted_requests():
    decision = decide(POLICY, _signals(_load(2, 1), rate=0.0, last_request_ago=5000))
    assert decision.action == "hold" and "idle" not in decision.reason


def test_never_used_deployment_goes_to_zero_after_the_idle_period_since_it_was_scaled():
    decision = decide(POLICY, _signals(_load(0), rate=0.0, last_request_ago=None, last_scaled_ago=700))
    assert (decision.action, decision.desired) == ("down", 0)
    assert "no request since it was scaled 12 min ago" in decision.reason


def test_keep_warm_min_replicas_and_popular_keep_one():
    idle = _signals(_load(0), rate=0.0, last_request_ago=5000)
    assert decide(replace(POLICY, keep_warm=True), idle).action == "hold"
    assert decide(replace(POLICY, min_replicas=1), idle).action == "hold"
    assert decide(POLICY, replace(idle, popular=True)).action == "hold"
    warm_from_zero = decide(POLICY, _signals(current=0, rate=0.0, last_request_ago=5000, popular=True))
    assert (warm_from_zero.action, warm_from_zero.desired) == ("up", 1)
    assert warm_from_zero.reason == "popular model: at least one replica"


def test_a_queued_cold_start_starts_a_replica_despite_the_cooldown():
    decision = decide(POLICY, _signals(current=0, rate=0.0, last_scaled_ago=1, queued=3))
    assert (decision.action, decision.desired) == ("up", 1)
    assert decision.reason == "3 request(s) wait for a cold start"
    assert decide(replace(POLICY, max_replicas=0), _signals(current=0, queued=3)).action == "hold"


def test_zero_stays_zero_without_traffic():
    decision = decide(POLICY, _signals(current=0, rate=0.0, last_request_ago=5000))
    assert (decision.action, decision.desired) == ("hold", 0)


def test_popular_is_the_top_k_by_traffic_with_ties_by_id_and_never_zero():
    counts = {5: 10.0, 3: 10.0, 9: 50.0, 2: 1.0, 7: 0.0}
    assert popular(counts, 2) == {9, 3}
    assert popular(counts, 10) == {9, 3, 5, 2}
    assert popular(counts, 0) == set()
    assert popular({}, 3) == set()


def test_the_policy_module_imports_only_the_standard_library():
    tree = ast.parse(Path(autoscaling.__file__).read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules <= {"math", "dataclasses"}


@pytest.mark.parametrize(
    "decision",
    [
        decide(POLICY, _signals(_load(8, 6), _load(8, 6))),
        decide(POLICY, _signals(_load(0), rate=0.0, last_request_ago=601)),
    ],
)
def test_every_decision_carries_its_inputs(decision):
    for key in (
        "current_replicas",
        "ready_replicas",
        "utilisation",
        "ttft_p95_s",
        "itl_p95_s",
        "kv_cache_usage",
        "request_rate_per_s",
        "idle_s",
        "since_scaled_s",
        "popular",
    ):
        assert key in decision.inputs


def test_shed_requests_count_as_demand_and_scale_up():
    """Half the arrivals shed: the replicas' queue is half the demand, and shedding is a breach."""
    admitted = _signals(_load(2, 0), _load(2, 0), rate=2.0)
    assert decide(POLICY, admitted).action == "hold"  # 4 in flight on 2 replicas: 50%, no scale-down below 1 each
    shedding = replace(admitted, shed_rate_per_s=1.0)
    decision = decide(POLICY, shedding)
    assert (decision.action, decision.desired) == ("up", 3)  # 8 in flight / (4 × 0.7)
    assert "1 requests/s shed (TTFT objective)" in decision.reason
    assert decision.inputs["shed_rate_per_s"] == 1.0 and decision.inputs["utilisation"] == 1.0


def test_everything_shed_still_reads_as_demand():
    assert autoscaling.shed_demand(0.0, _signals(_load(), rate=3.0, queued=0)) == 0.0
    everything = replace(_signals(_load(4, 0), rate=3.0), shed_rate_per_s=3.0)
    assert autoscaling.shed_demand(4.0, everything) == 7.0
    assert decide(POLICY, everything).action == "up"
