"""The autoscaling policy, as a pure function of a deployment's policy and its live signals: no
Django, no ORM, only the standard library, so the fleet simulator (bench/fleet_sim.py) drives the
same code the Celery beat task does, and every rule can be read and tested on its own."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalePolicy:
    """One deployment's autoscaling settings (its catalog fields, with defaults from settings)."""

    min_replicas: int
    max_replicas: int
    keep_warm: bool
    target_concurrency: float  # running+waiting requests per ready replica at utilisation 1.0
    target_utilisation: float  # scale up above target*(1+hysteresis), down below target*(1-hysteresis)
    hysteresis: float
    ttft_slo_s: float  # a ready replica's p95 above its SLO (while it has work) → scale up
    itl_slo_s: float
    kv_cache_high: float  # KV-cache use at or above it counts as saturated → scale up
    scale_up_cooldown_s: float
    scale_down_cooldown_s: float
    idle_to_zero_s: float  # no request (nor scaling) for this long → 0 replicas; 0 turns it off


@dataclass(frozen=True)
class ReplicaLoad:
    """One ready replica's figures from its worker's latest heartbeat (None when not reported)."""

    running: float
    waiting: float
    kv_cache_usage: float
    ttft_p95_s: float | None
    itl_p95_s: float | None


@dataclass(frozen=True)
class DeploymentSignals:
    now: float  # epoch seconds
    current_replicas: int  # active: pending + loading + ready
    loads: tuple[ReplicaLoad, ...]  # ready replicas only
    request_rate_per_s: float  # seen by the gateway over the recent window
    last_request_at: float | None  # epoch seconds, from the gateway
    last_scaled_at: float | None  # last change of desired_replicas (by anyone), for cooldowns
    popular: bool  # among the top K by traffic: keep at least one replica
    queued_cold_starts: int = 0  # requests waiting at the gateway for this model's first replica
    # Of request_rate_per_s, requests the gateway shed because the TTFT objective could not be met.
    shed_rate_per_s: float = 0.0


@dataclass(frozen=True)
class Decision:
    desired: int
    action: str  # "up" | "down" | "hold"
    reason: str  # one human sentence: why
    inputs: dict  # every figure the decision read (for the audit log and the fleet page)


UP, DOWN, HOLD = "up", "down", "hold"


def popular(request_counts: dict[int, float], top_k: int) -> set[int]:
    """The ids with the most traffic, at most `top_k` (ties go to the lower id); an id with no
    traffic is never popular."""
    ranked = sorted((-count, key) for key, count in request_counts.items() if count > 0)
    return {key for _, key in ranked[: max(0, top_k)]}


def floor_replicas(policy: AutoscalePolicy, *, popular: bool) -> int:
    """The fewest replicas the policy ever leaves: min_replicas, and one if kept warm or popular."""
    return max(policy.min_replicas, 1 if (policy.keep_warm or popular) else 0)


def shed_demand(admitted_demand: float, signals: DeploymentSignals) -> float:
    """The requests in flight had none been shed: the replicas' (admitted) running and waiting,
    scaled by arrivals over admissions, as a shed request would have stayed as long as an admitted
    one. Everything shed (nothing admitted to scale from): one request in flight per shed request/s."""
    shed, rate = signals.shed_rate_per_s, signals.request_rate_per_s
    if shed <= 0:
        return admitted_demand
    admitted = rate - shed
    if admitted <= 0 or admitted_demand <= 0:
        return admitted_demand + shed
    return admitted_demand * rate / admitted


def decide(policy: AutoscalePolicy, signals: DeploymentSignals) -> Decision:
    """The desired replica count for one deployment now, with why and every figure it read.

    In order: a request waiting for a first replica starts one at once; counts outside the bounds
    are brought inside them; a deployment idle for `idle_to_zero_s` goes to its floor (zero unless
    kept warm, popular or with a minimum); otherwise the ready replicas' load against the target
    utilisation (with hysteresis) and the latency/KV saturation signals move it one way or the
    other, each direction after its own cooldown.
    """
    now, current = signals.now, signals.current_replicas
    ready = len(signals.loads)
    floor = min(floor_replicas(policy, popular=signals.popular), policy.max_replicas)
    demand = shed_demand(sum(load.running + load.waiting for load in signals.loads), signals)
    per_replica = max(policy.target_concurrency, 1e-9)
    utilisation = demand / (ready * per_replica) if ready else None
    ttft = _worst(load.ttft_p95_s for load in signals.loads)
    itl = _worst(load.itl_p95_s for load in signals.loads)
    kv = max((load.kv_cache_usage for load in signals.loads), default=None)
    idle_since = max(
        (t for t in (signals.last_request_at, signals.last_scaled_at) if t is not None),
        default=None,
    )
    since_scaled = None if signals.last_scaled_at is None else now - signals.last_scaled_at
    inputs = {
        "current_replicas": current,
        "ready_replicas": ready,
        "running": _round(sum(load.running for load in signals.loads)),
        "waiting": _round(sum(load.waiting for load in signals.loads)),
        "utilisation": _round(utilisation),
        "target_utilisation": policy.target_utilisation,
        "target_concurrency": policy.target_concurrency,
        "ttft_p95_s": _round(ttft),
        "ttft_slo_s": policy.ttft_slo_s,
        "itl_p95_s": _round(itl),
        "itl_slo_s": policy.itl_slo_s,
        "kv_cache_usage": _round(kv),
        "kv_cache_high": policy.kv_cache_high,
        "request_rate_per_s": _round(signals.request_rate_per_s),
        "shed_rate_per_s": _round(signals.shed_rate_per_s),
        "idle_s": None if idle_since is None else _round(now - idle_since),
        "since_scaled_s": _round(since_scaled),
        "queued_cold_starts": signals.queued_cold_starts,
        "popular": signals.popular,
        "keep_warm": policy.keep_warm,
        "min_replicas": policy.min_replicas,
        "max_replicas": policy.max_replicas,
    }

    def decision(desired: int, reason: str) -> Decision:
        action = UP if desired > current else DOWN if desired < current else HOLD
        return Decision(desired=desired, action=action, reason=reason, inputs=inputs)

    def cooling(cooldown_s: float) -> bool:
        return since_scaled is not None and since_scaled < cooldown_s

    if current == 0 and policy.max_replicas > 0 and (signals.queued_cold_starts > 0 or signals.request_rate_per_s > 0):
        waiting = signals.queued_cold_starts
        return decision(
            max(1, floor),
            (
                f"{waiting} request(s) wait for a cold start"
                if waiting
                else f"requests arrive ({signals.request_rate_per_s:.2g}/s) and no replica is running"
            ),
        )
    if current < floor:
        return decision(floor, _below_floor_reason(policy, signals.popular, floor))
    if current > policy.max_replicas:
        return decision(policy.max_replicas, f"above the maximum of {policy.max_replicas}")

    # Replicas still working are not idle, whatever the gateway's counts say (they may be lost).
    idle = (
        policy.idle_to_zero_s > 0
        and signals.request_rate_per_s <= 0
        and signals.queued_cold_starts <= 0
        and demand <= 0
        and (idle_since is None or now - idle_since >= policy.idle_to_zero_s)
    )
    if idle and current > floor:
        if idle_since is None:
            idle_for = "no request seen"
        elif signals.last_request_at is None:
            idle_for = f"no request since it was scaled {_seconds(now - idle_since)} ago"
        else:
            idle_for = f"idle for {_seconds(now - idle_since)}"
        return decision(floor, f"{idle_for} (scale to {floor} after {_seconds(policy.idle_to_zero_s)})")

    if ready == 0:
        return decision(current, "waiting for a replica to become ready" if current else "no traffic")

    breaches = []
    if ttft is not None and demand > 0 and ttft > policy.ttft_slo_s:
        breaches.append(f"TTFT p95 {ttft:.2f} s above the {policy.ttft_slo_s:.2f} s SLO")
    if itl is not None and demand > 0 and itl > policy.itl_slo_s:
        breaches.append(f"inter-token p95 {itl * 1000:.0f} ms above the {policy.itl_slo_s * 1000:.0f} ms SLO")
    if signals.shed_rate_per_s > 0:
        breaches.append(f"{signals.shed_rate_per_s:.2g} requests/s shed (TTFT objective)")
    if kv is not None and kv >= policy.kv_cache_high:
        breaches.append(f"KV cache {kv:.0%} full (high mark {policy.kv_cache_high:.0%})")
    # Enough replicas for the demand at the target utilisation.
    needed = math.ceil(demand / (per_replica * policy.target_utilisation)) if demand > 0 else 0
    high = policy.target_utilisation * (1 + policy.hysteresis)
    low = policy.target_utilisation * (1 - policy.hysteresis)
    load_text = f"utilisation {utilisation:.0%} of {ready} ready (target {policy.target_utilisation:.0%})"

    if utilisation > high or breaches:
        why = "; ".join(([f"{load_text}, above {high:.0%}"] if utilisation > high else []) + breaches)
        want = min(policy.max_replicas, max(needed, ready + 1))
        if want <= current:
            if current >= policy.max_replicas:
                return decision(current, f"{why}, but already at the maximum of {policy.max_replicas}")
            return decision(current, f"{why}; {current - ready} replica(s) still loading")
        if cooling(policy.scale_up_cooldown_s):
            return decision(
                current,
                f"{why}; scale-up cooling down ({_seconds(since_scaled)} of {_seconds(policy.scale_up_cooldown_s)})",
            )
        return decision(want, why)

    if utilisation < low and current > max(floor, 1):
        want = max(needed, floor, 1)
        why = f"{load_text}, below {low:.0%}"
        if want >= current:
            return decision(current, f"{why}, but fewer replicas would run above the target")
        if cooling(policy.scale_down_cooldown_s):
            return decision(
                current,
                f"{why}; scale-down cooling down ({_seconds(since_scaled)} of "
                f"{_seconds(policy.scale_down_cooldown_s)})",
            )
        return decision(want, why)

    return decision(current, f"{load_text}, within {low:.0%}–{high:.0%}")


def _below_floor_reason(policy: AutoscalePolicy, popular: bool, floor: int) -> str:
    if policy.min_replicas >= floor:
        return f"below the minimum of {policy.min_replicas}"
    return "kept warm: at least one replica" if policy.keep_warm else "popular model: at least one replica"


def _worst(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _seconds(value: float) -> str:
    value = max(0.0, value)
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"
