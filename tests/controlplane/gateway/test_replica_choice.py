"""The router's replica choice as pure functions (the gateway's LocalShared and the fleet simulator
call them; test_shared.py checks the Redis script gives the same answers)."""

import json
from dataclasses import dataclass

from controlplane.gateway.replica_choice import (
    MAX_IMAGE_TOKENS,
    affinity_choice,
    affinity_key,
    image_tokens_estimate,
    least_outstanding,
    predicted_wait_s,
    prompt_tokens_estimate,
    queued_tokens,
)


@dataclass(frozen=True)
class R:
    replica_id: int


def test_affinity_needs_a_key_and_two_replicas():
    assert affinity_choice("", [R(1), R(2)]) is None
    assert affinity_choice("x" * 64, [R(1)]) is None
    assert affinity_choice("x" * 64, [R(1), R(2)]) in (0, 1)


def test_affinity_survives_another_replica_and_spreads_keys():
    key = affinity_key({"prompt": "system: be brief\nuser: " + "a long question " * 10}, False, 64)
    replicas = [R(i) for i in range(1, 6)]
    chosen = replicas[affinity_choice(key, replicas)]
    # Rendezvous hashing: a new replica takes a key only if it scores best; others stay put.
    grown = replicas + [R(99)]
    assert grown[affinity_choice(key, grown)] in (chosen, R(99))
    spread = {affinity_choice(f"conversation {i} " * 8, replicas) for i in range(50)}
    assert len(spread) == len(replicas)  # different conversations spread over the replicas


def test_a_completion_prompt_keys_on_its_first_chars_if_long_enough():
    prompt = "a long question " * 10
    assert affinity_key({"prompt": prompt}, False, 64) == prompt[:64]
    assert affinity_key({"prompt": prompt[:64] + "another tail"}, False, 64) == prompt[:64]
    assert affinity_key({"prompt": prompt[:63]}, False, 64) == ""
    assert affinity_key({"prompt": [1, 2, 3] * 30}, False, 64) == json.dumps([1, 2, 3] * 30)[:64]


SYSTEM = {"role": "system", "content": "You are the support assistant of a large shop. " * 25}  # 1,200 chars


def _chat(*messages: dict) -> dict:
    return {"model": "m", "messages": [SYSTEM, *messages]}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_conversations_behind_a_long_shared_system_prompt_get_different_keys_and_spread():
    keys = {affinity_key(_chat(_user(f"Where is my order {i}?")), True, 512) for i in range(50)}
    assert len(keys) == 50 and all(len(key) < 100 for key in keys)  # a digest, not the prompt itself
    replicas = [R(i) for i in range(1, 6)]
    assert {affinity_choice(key, replicas) for key in keys} == set(range(len(replicas)))


def test_a_conversations_later_turns_keep_its_first_turns_key():
    first = _chat(_user("Where is my order 7?"))  # short, but behind a long system prompt
    key = affinity_key(first, True, 512)
    assert key and key != affinity_key(_chat(_user("Where is my order 8?")), True, 512)
    later = _chat(
        _user("Where is my order 7?"),
        {"role": "assistant", "content": "It left today. " * 40},
        _user("When will it arrive?"),
        {"role": "assistant", "content": "Tomorrow."},
        _user("Thanks!"),
    )
    assert affinity_key(later, True, 512) == key
    replicas = [R(i) for i in range(1, 9)]
    assert affinity_choice(affinity_key(later, True, 512), replicas) == affinity_choice(key, replicas)


def test_another_system_prompt_or_a_long_opening_changes_the_key_only_as_it_should():
    key = affinity_key(_chat(_user("hello " * 200)), True, 512)
    assert affinity_key(_chat(_user("hello " * 200 + "and more")), True, 512) == key  # past `chars`
    other = {"model": "m", "messages": [{"role": "system", "content": SYSTEM["content"] + "!"}, _user("hello " * 200)]}
    assert affinity_key(other, True, 512) != key


def test_short_requests_are_not_pinned():
    assert affinity_key({"messages": [_user("hi")]}, True, 512) == ""
    assert affinity_key({"messages": [{"role": "system", "content": "Be brief."}, _user("hi")]}, True, 512) == ""
    assert affinity_key({"messages": []}, True, 512) == ""
    assert affinity_key({}, True, 512) == ""
    assert affinity_key({"messages": ["not a message", None]}, True, 512) == ""
    assert affinity_key({"prompt": None}, False, 512) == ""


def test_least_outstanding_keeps_affinity_within_max_extra():
    assert least_outstanding([3, 1, 2], [True] * 3, None, 2) == 1
    assert least_outstanding([3, 1, 2], [True] * 3, 0, 2) == 0  # 3 <= 1 + 2
    assert least_outstanding([4, 1, 2], [True] * 3, 0, 2) == 1  # overloaded: the least busy


def test_least_outstanding_passes_over_replicas_that_failed_unless_all_did():
    assert least_outstanding([0, 5], [False, True], None, 2) == 1
    assert least_outstanding([0, 5], [False, True], 0, 9) == 1  # even the affinity one
    assert least_outstanding([2, 5], [False, False], 1, 9) == 1  # all failed: affinity still counts
    assert least_outstanding([2, 5], [False, False], None, 9) == 0


@dataclass(frozen=True)
class Holder:
    replica_id: int
    prefix_keys: frozenset = frozenset()


def test_a_replica_holding_the_conversation_in_its_kv_tiers_is_preferred():
    from gpuworker.contract.prefix_keys import prefix_key_digest

    keys = [f"conversation {i} " * 8 for i in range(20)]
    plain = [Holder(1), Holder(2)]
    # For every key, the replica rendezvous hashing does not choose reports holding it: it wins.
    for key in keys:
        other = 1 - affinity_choice(key, plain)
        replicas = list(plain)
        replicas[other] = Holder(plain[other].replica_id, frozenset({prefix_key_digest(key)}))
        assert affinity_choice(key, replicas) == other
    # A digest of another conversation changes nothing.
    unrelated = [Holder(1, frozenset({prefix_key_digest("elsewhere")})), Holder(2)]
    assert [affinity_choice(key, unrelated) for key in keys] == [affinity_choice(key, plain) for key in keys]
    # Both hold it: rendezvous among the holders.
    both = [Holder(r, frozenset(prefix_key_digest(k) for k in keys)) for r in (1, 2)]
    assert [affinity_choice(key, both) for key in keys] == [affinity_choice(key, plain) for key in keys]


def test_the_prefix_key_header_carries_the_digest_only_with_a_key():
    from controlplane.gateway.replica_choice import prefix_key_header
    from gpuworker.contract.prefix_keys import PREFIX_KEY_HEADER, is_prefix_key_digest

    assert prefix_key_header("") == {}
    [(name, value)] = prefix_key_header("conversation " * 8).items()
    assert name == PREFIX_KEY_HEADER and is_prefix_key_digest(value)


def test_the_predicted_wait_is_the_queued_prompt_tokens_over_the_recent_prefill_rate():
    assert predicted_wait_s({"waiting_tokens": 6000, "prefill_tokens_per_s": 2000.0}) == 3.0
    # No queue, no measured rate, or no report at all: no evidence of a wait.
    for figures in (
        {"waiting_tokens": 0, "prefill_tokens_per_s": 2000.0},
        {"waiting_tokens": 6000, "prefill_tokens_per_s": 0.0},
        {"waiting_tokens": "many", "prefill_tokens_per_s": 1.0},
        {},
    ):
        assert predicted_wait_s(figures) == 0.0


def test_prompt_tokens_routed_since_the_report_join_its_queue():
    idle = {"waiting_tokens": 0, "prefill_tokens_per_s": 2000.0}
    assert predicted_wait_s(idle, routed=[(0.0, 3000)]) == 1.5
    assert predicted_wait_s({"waiting_tokens": 1000, "prefill_tokens_per_s": 2000.0}, routed=[(0.0, 3000)]) == 2.0
    # Without a measured rate there is still no evidence of a wait.
    assert predicted_wait_s({"waiting_tokens": 0, "prefill_tokens_per_s": 0.0}, routed=[(0.0, 3000)]) == 0.0
    assert [prompt_tokens_estimate(n) for n in (0, 3, 4000)] == [1, 1, 1000]
    assert prompt_tokens_estimate(4000, image_tokens=500) == 1500


def test_the_replica_prefills_at_its_rate_since_its_report_the_queue_and_the_routed_work_alike():
    busy = {"waiting_tokens": 3000, "prefill_tokens_per_s": 3000.0}
    assert predicted_wait_s(busy, since_report_s=1.0) == 0.0  # a report 1 s old: its queue is gone
    assert predicted_wait_s(busy, since_report_s=0.5) == 0.5
    # Work routed as the report came drains with the reported queue; never below empty.
    assert predicted_wait_s(busy, routed=[(0.0, 1500)], since_report_s=1.0) == 0.5
    assert predicted_wait_s(busy, routed=[(0.0, 1500)], since_report_s=5.0) == 0.0
    idle = {"waiting_tokens": 0, "prefill_tokens_per_s": 3000.0}
    assert predicted_wait_s(idle, routed=[(0.0, 4500)], since_report_s=0.5) == 1.0
    # A report stamped later than now (clocks apart) drains nothing rather than adding a wait.
    assert predicted_wait_s(busy, since_report_s=-2.0) == 1.0


def test_drain_takes_off_only_work_the_replica_had_not_idle_time_before_a_late_burst():
    idle = {"waiting_tokens": 0, "prefill_tokens_per_s": 1000.0}
    # Idle for 5 s after its report, then 3000 tokens at once: all of them still queued.
    assert predicted_wait_s(idle, routed=[(5.0, 3000)], since_report_s=5.0) == 3.0
    assert predicted_wait_s(idle, routed=[(5.0, 3000)], since_report_s=6.0) == 2.0
    # The reported queue drains first; what it leaves idle is not credited to later work.
    busy = {"waiting_tokens": 2000, "prefill_tokens_per_s": 1000.0}
    assert predicted_wait_s(busy, routed=[(1.0, 1000), (4.0, 3000)], since_report_s=4.5) == 2.5
    # Work routed back to back queues behind what came before it, as it is sent.
    assert queued_tokens(0.0, 1000.0, [(1.0, 1500), (2.0, 1500), (2.5, 500)], 3.0) == 1500.0
    # A request stamped before the report (clocks apart) counts as routed at the report.
    assert queued_tokens(500.0, 1000.0, [(-1.0, 1000)], 0.5) == 1000.0


def test_an_images_tokens_are_the_most_the_model_makes_of_one_and_fewer_at_low_detail():
    assert image_tokens_estimate("auto", max_image_pixels=8192 * 8192, low_detail_pixels=512 * 512) == MAX_IMAGE_TOKENS
    assert image_tokens_estimate("high", max_image_pixels=1024 * 1024, low_detail_pixels=512 * 512) == 1338
    assert image_tokens_estimate("low", max_image_pixels=8192 * 8192, low_detail_pixels=512 * 512) == 335
    assert image_tokens_estimate("low", max_image_pixels=256 * 256, low_detail_pixels=512 * 512) == 84
