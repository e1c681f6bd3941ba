"""Chaos and load: several tenants send mixed traffic through the gateway while faults are injected,
then the ledger is audited against what every client saw.

    python bench/chaos.py [--duration 600] [--tenants 4] [--concurrency 8] [--seed 0]
                          [--fault-interval 20] [--json report.json]

The whole system runs as real processes (`tests/integration/conftest.py:Fleet`: uvicorn serving the
control plane and the gateway, a Celery worker with beat, two worker daemons on CPU serving the
tiny demo model with two replicas) over a PostgreSQL and a Redis of its own, started here on free
ports in temporary folders (`tests/private_services.py`): the machine's shared services are never
touched. Tenants each have a key and credit (the last one credit for only a few requests) and
send chat and completion requests, streaming or not, with a JSON schema or tools; some clients
leave before the first token, mid-stream or while waiting for a whole answer
(`bench/chaos_traffic.py`). On a seeded schedule, one fault at a time: a replica SIGKILLed (its
daemon reports it and reconcile replaces it), a daemon SIGKILLed and restarted, Redis stopped and
started (empty), PostgreSQL stopped (`pg_ctl stop -m fast`) and started. At the end, after every
hold is settled or swept, `bench/chaos_audit.py` checks the invariants; the exit status is 0 only
when it finds nothing. `tests/integration/test_chaos.py` runs a short one in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.chaos_traffic import COMPLETED, ERROR, STREAM_ERROR, STAY, ClientRecord, Tenant, Traffic, send  # noqa: E402
from tests.private_services import PrivatePostgres, PrivateRedis  # noqa: E402

FAULTS = ("replica_kill", "daemon_kill", "redis_restart", "postgres_restart")
MODEL = "chaos-tiny"
REPLICAS = 2  # one per daemon: a killed replica or daemon leaves the other serving
PRICE = Decimal("0.002")
CREDIT = Decimal("100")
POOR_CREDIT = PRICE * 10  # the last tenant runs out after about ten requests
# The processes' settings: quick figures so faults are noticed and healed within seconds, and
# holds of requests whose settlement was lost are swept within the run (hold lifetime = request
# timeout + 60 s).
SYSTEM_ENV = {
    "OMP_NUM_THREADS": "1", "LOG_LEVEL": "WARNING", "FLEET_WORKER_LOST_AFTER_SECONDS": "6",
    "GATEWAY_REQUEST_TIMEOUT_SECONDS": "60", "GATEWAY_HOLD_SWEEP_SECONDS": "2",
}
HOLD_LIFETIME_S = 60 + 60


@dataclass
class Fault:
    kind: str
    detail: str
    injected: float  # time.monotonic()
    restored: float  # when the thing broken was back (the same as injected for a replica kill)
    recovered_s: float | None = None  # from restored to the end of the first request served after it
    replicas_whole_s: float | None = None  # from injected until both replicas were ready again, if one went
    server_errors: int = 0  # 5xx answers and stream error events clients saw between injection and recovery


class Chaos:
    """The private services and the system's processes over them, the faults, and the audit."""

    def __init__(self, scratch: Path, *, tenants: int):
        self.scratch = scratch
        self.postgres = PrivatePostgres()
        self.redis = PrivateRedis(scratch)
        self.tenant_count = tenants
        self.began = time.monotonic()  # every time reported is counted from here
        self.fleet = None
        self.daemons = []
        self.samples: list[tuple[float, int | None]] = []  # (time, ready replicas) every half second
        self.replica_changes: list[str] = []  # each replica's state changes as sampled, with its reason
        self._sampling = threading.Event()

    # --- start and stop -----------------------------------------------------------------------

    def start(self) -> list[Tenant]:
        self.postgres.start()
        self.postgres.create_database()
        self.redis.start()
        os.environ.update(DATABASE_URL=self.postgres.url, REDIS_URL=self.redis.url, DEBUG="1",
                          GPUSERVE_WORKER_TOKEN=secrets.token_urlsafe(24), VAR_DIR=str(self.scratch / "script"),
                          DJANGO_SETTINGS_MODULE="controlplane.settings", LOG_LEVEL="WARNING")
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from gpuworker.demo_model import write_demo_model
        from tests.integration.conftest import Fleet

        (self.scratch / "system").mkdir()
        self.fleet = Fleet(self.scratch / "system", self.redis.url)
        models = self.scratch / "system" / "var" / "models"
        self.fleet.env.update(SYSTEM_ENV, GPUSERVE_MODEL_ROOTS=str(models))
        checkpoint = write_demo_model(models / MODEL, max_position_embeddings=512)
        tenants = self._seed(checkpoint)
        self.fleet.start_control_plane()
        self.daemons = [self.fleet.start_daemon("a"), self.fleet.start_daemon("b")]
        self._wait_for_replicas()
        return tenants

    def _seed(self, checkpoint: Path) -> list[Tenant]:
        from controlplane.accounts.services import api_key_create, tenant_create
        from controlplane.billing.services import credit_grant, plan_create, price_tier_create
        from controlplane.catalog.services import model_create
        from controlplane.fleet.services import deployment_create

        # No monthly allowance: every charged request is a ledger entry.
        plan = plan_create(name="chaos", included_requests_per_month=0, rate_limit_per_minute=100_000,
                           max_concurrent_requests=64)
        tier = price_tier_create(name="chaos", price_per_request=PRICE, reference_price_per_million_tokens=Decimal("0.5"))
        model_create(public_name=MODEL, family="llama", kind="chat", weights_path=str(checkpoint), context_length=512,
                     parameter_count=4_000_000, price_tier=tier)
        # Hand-scaled: the run counts on exactly REPLICAS replicas, which the autoscaler would move.
        self.deployment = deployment_create(model_name=MODEL, desired_replicas=REPLICAS, max_replicas=REPLICAS + 1,
                                            autoscale=False)
        tenants = []
        for i in range(self.tenant_count):
            poor = i == self.tenant_count - 1 and self.tenant_count > 1
            tenant = tenant_create(name=f"chaos-{'poor' if poor else i + 1}", plan=plan)
            credit_grant(tenant=tenant, amount=POOR_CREDIT if poor else CREDIT, memo="chaos run")
            tenants.append(Tenant(tenant.name, api_key_create(tenant=tenant, name="chaos").plaintext))
        return tenants

    def _wait_for_replicas(self) -> None:
        from tests.integration.conftest import wait_until

        wait_until(lambda: self.ready_replicas() == REPLICAS, timeout=240, what=f"{REPLICAS} ready replicas",
                   fleet=self.fleet)

    def ready_replicas(self) -> int:
        from controlplane.fleet.models import Replica

        return Replica.objects.filter(deployment=self.deployment, state=Replica.State.READY).count()

    def _replica_states(self, known: dict) -> int:
        """Note each replica's state change since the last look; return how many are ready."""
        from controlplane.fleet.models import Replica

        ready = 0
        for replica in Replica.objects.filter(deployment=self.deployment).select_related("worker"):
            ready += replica.state == Replica.State.READY
            if known.get(replica.pk) != replica.state:
                known[replica.pk] = replica.state
                reason = f" ({replica.failure}: {replica.last_error[:120]})" if replica.last_error else ""
                self.replica_changes.append(f"[{time.monotonic() - self.began:5.0f}s] replica {replica.pk} on "
                                            f"{replica.worker.name}: {replica.state}{reason}")
        return ready

    def stop(self) -> None:
        self._sampling.set()
        if self.fleet is not None:
            self.fleet.stop()
        self.redis.stop()
        self.postgres.remove()

    # --- the replicas' readiness over time ------------------------------------------------------

    def sample_readiness(self) -> threading.Thread:
        from django.db import connection

        def run():
            known: dict[int, str] = {}
            while not self._sampling.wait(0.5):
                try:
                    count = self._replica_states(known)
                except Exception:  # the database is what is down; try again with a new connection
                    connection.close()
                    count = None
                self.samples.append((time.monotonic(), count))
            connection.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    # --- faults (each returns once what it broke is back) ---------------------------------------

    def replica_kill(self, rng: random.Random) -> Fault:
        from tests.integration.conftest import _children_of

        replicas = [pid for daemon in self.daemons if daemon.popen.poll() is None
                    for pid in _children_of(daemon.popen.pid) if b"serve" in _cmdline(pid)]
        if not replicas:
            now = time.monotonic()
            return Fault("replica_kill", "no replica process to kill", now, now)
        pid = rng.choice(replicas)
        now = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return Fault("replica_kill", f"replica pid {pid}", now, now)

    def daemon_kill(self, rng: random.Random) -> Fault:
        daemon = rng.choice(self.daemons)
        injected = time.monotonic()
        self.fleet.kill(daemon)
        time.sleep(rng.uniform(1, 4))
        self.daemons[self.daemons.index(daemon)] = self.fleet.restart(daemon)
        return Fault("daemon_kill", f"{daemon.name}, restarted after {time.monotonic() - injected:.1f}s",
                     injected, time.monotonic())

    def redis_restart(self, rng: random.Random) -> Fault:
        return self._outage("redis_restart", self.redis, rng)

    def postgres_restart(self, rng: random.Random) -> Fault:
        return self._outage("postgres_restart", self.postgres, rng)

    def _outage(self, kind: str, service: PrivateRedis | PrivatePostgres, rng: random.Random) -> Fault:
        injected = time.monotonic()
        service.stop()
        time.sleep(rng.uniform(2, 6))
        service.start()
        return Fault(kind, f"down {time.monotonic() - injected:.1f}s", injected, time.monotonic())

    async def inject_faults(self, until: float, rng: random.Random, interval: float) -> list[Fault]:
        """One fault at a time, `interval` seconds apart on average, every kind once per round in a
        seeded order; none starts within 10 s of the end."""
        faults, order = [], []
        while True:
            await asyncio.sleep(rng.uniform(0.6, 1.2) * interval)
            if time.monotonic() > until - 10:
                return faults
            if not order:
                order = rng.sample(FAULTS, len(FAULTS))
            kind = order.pop()
            fault = await asyncio.to_thread(getattr(self, kind), rng)
            print(f"[{fault.injected - self.began:5.0f}s] fault {len(faults) + 1}: {fault.kind} ({fault.detail})",
                  flush=True)
            faults.append(fault)

    # --- the end --------------------------------------------------------------------------------

    def wait_settled(self, tenants: list[Tenant]) -> bool:
        """Until no hold is left (the sweeper takes those whose settlement was lost), at most a
        hold's lifetime and two sweeps from now."""
        from django.db import connection

        from controlplane.billing.models import CreditHold

        connection.close()  # its server may have restarted since it was opened
        deadline = time.monotonic() + HOLD_LIFETIME_S + 30
        names = [t.name for t in tenants]
        while CreditHold.objects.filter(tenant__name__in=names).exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(1)
        return True


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def measure_recovery(faults: list[Fault], records: list[ClientRecord], samples) -> None:
    """For each fault: the first request that started after it was restored and was served whole
    (and how long after the restore it ended); when both replicas were ready again, if one went
    before the next fault."""
    served = sorted((r for r in records if r.outcome == COMPLETED), key=lambda r: r.started)
    for fault, following in zip(faults, [*faults[1:], None]):
        first = next((r for r in served if r.started >= fault.restored), None)
        fault.recovered_s = None if first is None else first.ended - fault.restored
        until = first.ended if first else float("inf")
        fault.server_errors = sum(1 for r in records if fault.injected <= r.ended <= until and (
            r.outcome == STREAM_ERROR or (r.outcome == ERROR and r.status >= 500)))
        # A dip counts only before the next fault, whose own dip it would otherwise be.
        after = [(t, n) for t, n in samples if t >= fault.injected and (following is None or t < following.injected)]
        dip = next((i for i, (_, n) in enumerate(after) if n is not None and n < REPLICAS), None)
        if dip is not None:
            back = next((t for t, n in after[dip:] if n is not None and n >= REPLICAS), None)
            fault.replicas_whole_s = None if back is None else back - fault.injected


def report(args, records: list[ClientRecord], faults: list[Fault], result, settled: bool, began: float,
           started: float, elapsed: float) -> dict:
    outcomes = Counter(r.label for r in records)
    by_plan = Counter(r.plan for r in records)
    lines = [f"chaos run: {elapsed:.0f}s of traffic from {started - began:.0f}s, {args.tenants} tenants, {args.concurrency} clients, "
             f"seed {args.seed}, a fault every ~{args.fault_interval:.0f}s",
             f"requests: {len(records)} ({', '.join(f'{n} {plan}' for plan, n in sorted(by_plan.items()))})",
             "", "| outcome seen by the client | requests | what the ledger did |", "|---|---|---|"]
    lines += [f"| {label} | {n} | {', '.join(f'{k} {v}' for k, v in sorted(result.ledger_by_outcome[label].items()))} |"
              for label, n in sorted(outcomes.items(), key=lambda kv: -kv[1])]
    lines += ["", "| # | fault | detail | at (s) | served again after (s) | both replicas ready after (s) | "
              "5xx seen meanwhile |", "|---|---|---|---|---|---|---|"]
    def secs(value):
        return "-" if value is None else f"{value:.1f}"

    lines += [f"| {i} | {f.kind} | {f.detail} | {f.injected - began:.0f} | {secs(f.recovered_s)} | "
              f"{secs(f.replicas_whole_s)} | {f.server_errors} |" for i, f in enumerate(faults, 1)]
    lines += ["", f"charged requests {result.charged} = ledger usage entries {result.ledger_usage_entries}; "
              f"recorded unbilled {result.recorded_unbilled}; released {result.released}; "
              f"every hold settled: {'yes' if settled else 'NO'}"]
    for name in result.PROBLEMS:
        found = getattr(result, name)
        lines.append(f"{name.replace('_', ' ')}: {len(found)}" + "".join(f"\n    {item}" for item in found[:20]))
    lines.append(f"audit: {'OK' if result.ok and settled else 'FAILED'}")
    print("\n".join(lines), flush=True)
    return {"options": vars(args), "seconds": elapsed, "requests": len(records), "outcomes": dict(outcomes),
            "faults": [asdict(f) for f in faults], "settled": settled, "audit": result.to_json(),
            "table": "\n".join(lines)}


async def traffic_with_faults(chaos: Chaos, tenants: list[Tenant], args) -> tuple[list[ClientRecord], list[Fault],
                                                                                 float, float]:
    import httpx

    traffic = Traffic(chaos.fleet.url, MODEL, tenants, args.concurrency, args.seed)
    # One request served end to end before the clock starts: the gateway routes the model.
    async with httpx.AsyncClient(base_url=chaos.fleet.url, timeout=90) as client:
        deadline = time.monotonic() + 120
        while True:
            record = await send(client, tenants[0], "chat", STAY, MODEL, random.Random(args.seed))
            traffic.records.append(record)
            if record.outcome == COMPLETED:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no request was served within 120s: {record}")
            await asyncio.sleep(0.5)
    started = time.monotonic()
    until = started + args.duration
    faults, _ = await asyncio.gather(chaos.inject_faults(until, random.Random(args.seed), args.fault_interval),
                                     traffic.run(args.duration))
    return traffic.records, faults, started, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--tenants", type=int, default=4, help="tenants (the last has credit for ~10 requests)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault-interval", type=float, default=20.0, help="mean seconds between faults")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (logs) afterwards")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="chaos-"))
    chaos = Chaos(scratch, tenants=args.tenants)

    def say(text: str) -> None:
        print(f"[{time.monotonic() - chaos.began:5.0f}s] {text}", flush=True)

    try:
        say(f"starting the system in {scratch}")
        tenants = chaos.start()
        say(f"running {args.duration:.0f}s of traffic with faults")
        sampler = chaos.sample_readiness()
        records, faults, started, elapsed = asyncio.run(traffic_with_faults(chaos, tenants, args))
        chaos._sampling.set()
        sampler.join(10)
        say("waiting for every hold to be settled")
        settled = chaos.wait_settled(tenants)
        say("auditing")
        from bench.chaos_audit import audit

        measure_recovery(faults, records, chaos.samples)
        summary = report(args, records, faults, audit(records, [t.name for t in tenants]), settled, chaos.began, started,
                         elapsed)
        if args.json:
            summary["records"] = [r.to_json() for r in records]
            summary["replica_changes"] = chaos.replica_changes
            args.json.write_text(json.dumps(summary, indent=1, default=str))
        return 0 if summary["audit"]["ok"] and settled else 1
    except BaseException:
        if chaos.fleet is not None:
            print(chaos.fleet.logs(), file=sys.stderr)
        raise
    finally:
        say("stopping the system")
        chaos.stop()
        say("stopped")
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
