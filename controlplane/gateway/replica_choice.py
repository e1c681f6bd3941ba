"""The router's replica choice as pure functions (standard library only), so the gateway and the
fleet simulator (bench/fleet_sim.py) run the same rule. The Redis Lua script in scripts.py
(_PICK) is the one other copy, because Redis runs it atomically; test_shared.py checks both agree.
"""

import hashlib
from collections.abc import Sequence
from typing import Protocol


class HasReplicaId(Protocol):
    replica_id: int


def affinity_choice(prefix: str, candidates: Sequence[HasReplicaId], min_chars: int) -> int | None:
    """The index of the replica a long prompt's prefix belongs to (rendezvous hashing: stable
    while replicas come and go, and the same in every gateway process), or None if too short."""
    if len(prefix) < min_chars or len(candidates) < 2:
        return None
    digest = hashlib.blake2b(prefix[:min_chars].encode("utf-8", "surrogatepass"), digest_size=16).digest()
    scores = [hashlib.blake2b(b"%d" % replica.replica_id, key=digest, digest_size=8).digest()
              for replica in candidates]
    return max(range(len(candidates)), key=scores.__getitem__)


def least_outstanding(counts: Sequence[int], up: Sequence[bool], affinity: int | None, max_extra: int) -> int:
    """The index to send a request to: the replica with the fewest outstanding requests among those
    up (all of them if none is), or the affinity replica while it has at most max_extra more."""
    indexes = range(len(counts))
    # Replicas that failed recently are passed over; if all did, the least busy is tried anyway.
    best = min((i for i in indexes if up[i]), key=counts.__getitem__, default=None)
    if best is None:
        best = min(indexes, key=counts.__getitem__)
    if affinity is not None and (up[affinity] or not any(up)) and counts[affinity] <= counts[best] + max_extra:
        best = affinity
    return best
