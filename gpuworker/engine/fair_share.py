"""The waiting queue and the order of admission: arrival order, or fair shares between tenants
with priority classes.

Fair shares follow the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024). Each tenant has a counter of the service it got, in weighted tokens divided by
the tenant's weight; the scheduler admits from the backlogged tenant (one with requests waiting)
whose counter is least. It is work-conserving: a lone backlogged tenant takes the whole GPU. A
tenant that comes back from idle has its counter lifted to the least counter of the backlogged
tenants, so the service it did not ask for while idle is not owed to it in a burst. Between two
tenants backlogged over the same interval, the service gap stays within twice the most one tenant
can be served at once.

Priority classes come before tenants: an interactive request is admitted before any batch one.
No torch here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from gpuworker.engine.config import SCHEDULING_POLICIES
from gpuworker.engine.sampling_params import PRIORITIES
from gpuworker.engine.sequence import Sequence

# Requests without a tenant share this one.
DEFAULT_TENANT = ""
# The paper's costs: an output token costs twice a prompt token (a decode step reads the whole KV
# of its sequence to produce one token, a prefill computes many tokens in one pass).
INPUT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0

_RANK = {priority: rank for rank, priority in enumerate(PRIORITIES)}


def tenant_of(seq: Sequence) -> str:
    return seq.group.params.tenant or DEFAULT_TENANT


def chunk_cost(num_new_tokens: int, samples: bool) -> float:
    """Weighted tokens of one step's chunk of a sequence: the tokens it computes, of which the last
    is an output token when the chunk samples (a decode is one output token)."""
    return INPUT_TOKEN_COST * (num_new_tokens - samples) + OUTPUT_TOKEN_COST * samples


class TenantCounters:
    """Per tenant: the virtual counter (weighted tokens / weight) that orders admission; and per
    (tenant, priority class) the weighted tokens served, which the replica's metrics show."""

    def __init__(self) -> None:
        self.virtual: dict[str, float] = {}
        self.served: dict[tuple[str, str], float] = {}
        self.weight: dict[str, float] = {}
        # The counter of the tenant served last: where a tenant returning while nobody is
        # backlogged starts from.
        self.floor = 0.0

    def charge(self, seq: Sequence, num_new_tokens: int, samples: bool, sign: int = 1) -> None:
        """Count a chunk scheduled for seq (sign -1: take back a chunk removed from the step)."""
        tenant = tenant_of(seq)
        cost = sign * chunk_cost(num_new_tokens, samples)
        served = (tenant, seq.group.params.priority)
        self.served[served] = self.served.get(served, 0.0) + cost
        self.virtual[tenant] = self.virtual.get(tenant, 0.0) + cost / self.weight.get(tenant, 1.0)

    def lift(self, tenant: str, backlogged: Iterable[str]) -> None:
        """A tenant that was idle starts from the least counter of those backlogged (or from the
        floor when none is), never below its own."""
        counters = [self.virtual.get(other, 0.0) for other in backlogged]
        start = min(counters) if counters else self.floor
        self.virtual[tenant] = max(self.virtual.get(tenant, 0.0), start)


class WaitingQueue:
    """Sequences waiting for admission, in lanes of (priority class, tenant), each in arrival order.

    "fcfs" keeps one lane: plain arrival order, tenants and classes ignored. "fair" admits from the
    first class with a waiting request, and within it from the lane whose tenant's counter is least
    (ties: the older head). A preempted or passed-over sequence goes back to the front of its lane.
    """

    def __init__(self, policy: str) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.fair = policy == "fair"
        self.counters = TenantCounters()
        self._lanes: dict[tuple[int, str], deque[Sequence]] = {}
        self._len = 0

    def rank(self, seq: Sequence) -> int:
        """The sequence's class rank (0 is served first; always 0 in arrival order)."""
        return _RANK[seq.group.params.priority] if self.fair else 0

    def best_rank(self) -> int | None:
        """The best class rank with a sequence waiting (None when none waits)."""
        return min(self._lanes)[0] if self._lanes else None

    def _lane(self, seq: Sequence) -> tuple[int, str]:
        return (self.rank(seq), tenant_of(seq) if self.fair else DEFAULT_TENANT)

    def append(self, seq: Sequence) -> None:
        """A new request's sequence, behind its lane."""
        if self.fair:
            tenant = tenant_of(seq)
            self.counters.weight[tenant] = seq.group.params.tenant_weight
            backlogged = {key[1] for key in self._lanes}
            if tenant not in backlogged:
                self.counters.lift(tenant, backlogged)
        self._lanes.setdefault(self._lane(seq), deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """A sequence back from running (preempted) or passed over: the front of its lane."""
        self._lanes.setdefault(self._lane(seq), deque()).appendleft(seq)
        self._len += 1

    def extendleft(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            self.appendleft(seq)

    def peek(self) -> Sequence:
        """The sequence to admit next (IndexError when none waits)."""
        if not self._lanes:
            raise IndexError("no sequence is waiting")
        virtual = self.counters.virtual
        key = min(
            self._lanes,
            key=lambda lane: (lane[0], virtual.get(lane[1], 0.0), self._lanes[lane][0].group.arrival_index),
        )
        return self._lanes[key][0]

    def popleft(self) -> Sequence:
        """Take the sequence peek() names."""
        seq = self.peek()
        self.remove(seq)
        if self.fair:
            self.counters.floor = max(self.counters.floor, self.counters.virtual.get(tenant_of(seq), 0.0))
        return seq

    def remove(self, seq: Sequence) -> None:
        key = self._lane(seq)
        lane = self._lanes[key]
        lane.remove(seq)
        self._len -= 1
        if not lane:
            del self._lanes[key]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and seq in self._lanes.get(self._lane(seq), ())

    def __iter__(self) -> Iterator[Sequence]:
        for key in sorted(self._lanes):
            yield from self._lanes[key]

    def __getitem__(self, index: int) -> Sequence:
        if index == 0:
            return self.peek()
        return list(self)[index]
