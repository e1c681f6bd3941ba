"""The router's replica choice as pure functions (the gateway's LocalShared and the fleet simulator
call them; test_shared.py checks the Redis script gives the same answers)."""

from dataclasses import dataclass

from controlplane.gateway.replica_choice import affinity_choice, least_outstanding


@dataclass(frozen=True)
class R:
    replica_id: int


def test_affinity_needs_a_long_prefix_and_two_replicas():
    assert affinity_choice("x" * 63, [R(1), R(2)], 64) is None
    assert affinity_choice("x" * 64, [R(1)], 64) is None
    assert affinity_choice("x" * 64, [R(1), R(2)], 64) in (0, 1)


def test_affinity_hashes_only_the_first_chars_and_survives_another_replica():
    prefix = "system: be brief\nuser: " + "a long question " * 10
    replicas = [R(i) for i in range(1, 6)]
    chosen = replicas[affinity_choice(prefix, replicas, 64)]
    assert replicas[affinity_choice(prefix[:64] + "another tail", replicas, 64)] == chosen
    # Rendezvous hashing: a new replica takes a prefix only if it scores best; others stay put.
    grown = replicas + [R(99)]
    assert grown[affinity_choice(prefix, grown, 64)] in (chosen, R(99))
    spread = {affinity_choice(f"conversation {i} " * 8, replicas, 64) for i in range(50)}
    assert len(spread) == len(replicas)  # different conversations spread over the replicas


def test_least_outstanding_keeps_affinity_within_max_extra():
    assert least_outstanding([3, 1, 2], [True] * 3, None, 2) == 1
    assert least_outstanding([3, 1, 2], [True] * 3, 0, 2) == 0  # 3 <= 1 + 2
    assert least_outstanding([4, 1, 2], [True] * 3, 0, 2) == 1  # overloaded: the least busy


def test_least_outstanding_passes_over_replicas_that_failed_unless_all_did():
    assert least_outstanding([0, 5], [False, True], None, 2) == 1
    assert least_outstanding([0, 5], [False, True], 0, 9) == 1  # even the affinity one
    assert least_outstanding([2, 5], [False, False], 1, 9) == 1  # all failed: affinity still counts
    assert least_outstanding([2, 5], [False, False], None, 9) == 0
