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
(`bench/chaos_traffic.py`). On a seeded schedule, one fault at a time, every kind once per round
(FAULT_HELP says what each does). A fault that finds nothing to act on, or whose effect is never
seen, is a failure of the run: its audit lists it. At the end, after every hold is settled or
swept, `bench/chaos_audit.py` checks the invariants; the exit status is 0 only when it finds
nothing. `tests/integration/test_chaos.py` runs a short one in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.chaos_traffic import COMPLETED, ERROR, STAY, STREAM_ERROR, ClientRecord, Tenant, Traffic, send  # noqa: E402
from bench.replica_faults import ReplicaProcess, kill_replica, poll, replica_processes  # noqa: E402
from tests.private_services import PrivatePostgres, PrivateRedis  # noqa: E402

FAULT_HELP = {
    "replica_kill": "SIGKILL a ready replica's process, found by the pid its daemon reports in heartbeats (as "
    "the control plane recorded them), never by process name; it must then be recorded failed "
    "and a new replica become ready",
    "daemon_kill": "SIGKILL a running worker daemon (its replicas exit with it) and restart it 1-4 s later",
    "redis_restart": "stop the private Redis and start it again, empty, 2-6 s later",
    "postgres_restart": "stop the private PostgreSQL (pg_ctl stop -m fast) and start it again 2-6 s later",
}
FAULTS = tuple(FAULT_HELP)
MODEL = "chaos-tiny"
REPLICAS = 2  # one per daemon: a killed replica or daemon leaves the other serving
PRICE = Decimal("0.002")
CREDIT = Decimal("100")
POOR_CREDIT = PRICE * 10  # the last tenant runs out after about ten requests
# The processes' settings: quick figures so faults are noticed and healed within seconds, and
# holds of requests whose settlement was lost are swept within the run (hold lifetime = request
# timeout + 60 s).
SYSTEM_ENV = {
    "OMP_NUM_THREADS": "1",
    "LOG_LEVEL": "WARNING",
    "FLEET_WORKER_LOST_AFTER_SECONDS": "6",
    "GATEWAY_REQUEST_TIMEOUT_SECONDS": "60",
    "GATEWAY_HOLD_SWEEP_SECONDS": "2",
}
HOLD_LIFETIME_S = 60 + 60
# How long a replica kill waits for every replica to be ready with its process reported, and so for
# longer than the gateway takes to route to a new one (the fault before may have taken one, and
# killing the last would test an outage, not a fail-over; past this it takes what is there), then
# for the control plane to record the killed replica failed, then for a new one to be ready.
REPLICA_TARGET_WAIT_S = 120
REPLICA_FAILED_WAIT_S = 60
REPLICA_REPLACED_WAIT_S = 180


@dataclass
class Fault:
    kind: str
    detail: str
    injected: float  # time.monotonic()
    restored: float  # when the thing broken was back (the same as injected for a replica kill)
    recovered_s: float | None = None  # from restored to the end of the first request served after it
    replicas_whole_s: float | None = None  # from injected until both replicas were ready again, if one went
    server_errors: int = 0  # 5xx answers and stream error events clients saw between injection and recovery
    # Why the fault did not do what it is for (it found nothing to act on, or its effect was never
    # seen); empty when it did. Any one fails the run.
    problem: str = ""
    # A replica kill's target, as its daemon reported it, and what the control plane then recorded.
    replica_id: int | None = None
    pid: int | None = None
    failure_seen: str = ""  # the killed replica's recorded failure and error
    failed_seen_s: float | None = None  # from the kill until the control plane recorded the replica failed
    replaced_s: float | None = None  # from the kill until a replica created after it was ready


class Chaos:
    """The private services and the system's processes over them, the faults, and the audit."""

    def __init__(self, scratch: Path, *, tenants: int):
        self.scratch = scratch
        self.postgres: PrivatePostgres | None = None  # made (initdb) when the run starts
        self.redis = PrivateRedis(scratch)
        self.tenant_count = tenants
        self.deployment = None  # the run's one deployment, made when it starts
        self.began = time.monotonic()  # every time reported is counted from here
        self.fleet = None
        self.daemons = []
        self.samples: list[tuple[float, int | None]] = []  # (time, ready replicas) every half second
        self.replica_changes: list[str] = []  # each replica's state changes as sampled, with its reason
        self._sampling = threading.Event()

    # --- start and stop -----------------------------------------------------------------------

    def start(self) -> list[Tenant]:
        self.postgres = PrivatePostgres()
        self.postgres.start()
        self.postgres.create_database()
        self.redis.start()
        os.environ.update(
            DATABASE_URL=self.postgres.url,
            REDIS_URL=self.redis.url,
            DEBUG="1",
            GPUSERVE_WORKER_TOKEN=secrets.token_urlsafe(24),
            VAR_DIR=str(self.scratch / "script"),
            DJANGO_SETTINGS_MODULE="controlplane.settings",
            LOG_LEVEL="WARNING",
        )
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
        from controlplane.fleet.services.deployments import deployment_create

        # No monthly allowance: every charged request is a ledger entry.
        plan = plan_create(
            name="chaos", included_requests_per_month=0, rate_limit_per_minute=100_000, max_concurrent_requests=64
        )
        tier = price_tier_create(
            name="chaos", price_per_request=PRICE, reference_price_per_million_tokens=Decimal("0.5")
        )
        model_create(
            public_name=MODEL,
            family="llama",
            kind="chat",
            weights_path=str(checkpoint),
            context_length=512,
            parameter_count=4_000_000,
            price_tier=tier,
        )
        # Hand-scaled: the run counts on exactly REPLICAS replicas, which the autoscaler would move.
        self.deployment = deployment_create(
            model_name=MODEL, desired_replicas=REPLICAS, max_replicas=REPLICAS + 1, autoscale=False
        )
        tenants = []
        for i in range(self.tenant_count):
            poor = i == self.tenant_count - 1 and self.tenant_count > 1
            tenant = tenant_create(name=f"chaos-{'poor' if poor else i + 1}", plan=plan)
            credit_grant(tenant=tenant, amount=POOR_CREDIT if poor else CREDIT, memo="chaos run")
            tenants.append(Tenant(tenant.name, api_key_create(tenant=tenant, name="chaos").plaintext))
        return tenants

    def _wait_for_replicas(self) -> None:
        from tests.integration.conftest import wait_until

        wait_until(
            lambda: self.ready_replicas() == REPLICAS, timeout=240, what=f"{REPLICAS} ready replicas", fleet=self.fleet
        )

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
                self.replica_changes.append(
                    f"[{time.monotonic() - self.began:5.0f}s] replica {replica.pk} on "
                    f"{replica.worker.name}: {replica.state}{reason}"
                )
        return ready

    def stop(self) -> None:
        self._sampling.set()
        if self.fleet is not None:
            self.fleet.stop()
        self.redis.stop()
        if self.postgres is not None:
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
        from django.conf import settings

        settle_s = 2 * settings.GATEWAY_ROUTING_REFRESH_MS / 1000
        targets: list[ReplicaProcess] = []
        whole: dict[frozenset[int], float] = {}  # the whole fleet's replica ids, as last seen: since when

        def settled() -> bool:
            targets.clear()  # a look that fails finds nothing, never what an earlier look found
            targets.extend(self.replica_processes())
            ids = frozenset(t.replica_id for t in targets)
            since = whole.get(ids, time.monotonic())
            whole.clear()
            if len(ids) < REPLICAS:
                return False
            whole[ids] = since
            return time.monotonic() - since >= settle_s

        poll(settled, REPLICA_TARGET_WAIT_S)
        if not targets:
            now = time.monotonic()
            return Fault(
                "replica_kill",
                "nothing killed",
                now,
                now,
                problem=(f"no ready replica with a live process its daemon reported within {REPLICA_TARGET_WAIT_S}s"),
            )
        target = rng.choice(targets)
        only = " (the only ready one)" if len(targets) == 1 else ""
        kill = kill_replica(target, failed_wait_s=REPLICA_FAILED_WAIT_S, replaced_wait_s=REPLICA_REPLACED_WAIT_S)
        if not kill.killed:
            return Fault("replica_kill", "nothing killed", kill.killed_at, kill.killed_at, problem=kill.problem)
        return Fault(
            "replica_kill",
            f"replica {target.replica_id} on {target.worker}, pid {target.pid}{only}",
            kill.killed_at,
            kill.killed_at,
            problem=kill.problem,
            replica_id=target.replica_id,
            pid=target.pid,
            failure_seen=kill.failure_seen,
            failed_seen_s=kill.failed_seen_s,
            replaced_s=kill.replaced_s,
        )

    def replica_processes(self) -> list[ReplicaProcess]:
        """The ready replicas of the run's deployment whose daemon, one of ours and running, reports
        the process serving them (bench/replica_faults.py)."""
        daemons = {daemon.name: daemon.popen.pid for daemon in self.daemons if daemon.popen.poll() is None}
        return replica_processes(deployment_ids=[self.deployment.pk], daemons=daemons)

    def daemon_kill(self, rng: random.Random) -> Fault:
        running = [daemon for daemon in self.daemons if daemon.popen.poll() is None]
        injected = time.monotonic()
        if not running:
            return Fault("daemon_kill", "nothing killed", injected, injected, problem="no worker daemon was running")
        daemon = rng.choice(running)
        self.fleet.kill(daemon)
        time.sleep(rng.uniform(1, 4))
        self.daemons[self.daemons.index(daemon)] = self.fleet.restart(daemon)
        return Fault(
            "daemon_kill",
            f"{daemon.name}, restarted after {time.monotonic() - injected:.1f}s",
            injected,
            time.monotonic(),
        )

    def redis_restart(self, rng: random.Random) -> Fault:
        return self._outage("redis_restart", self.redis, rng)

    def postgres_restart(self, rng: random.Random) -> Fault:
        return self._outage("postgres_restart", self.postgres, rng)

    def _outage(self, kind: str, service: PrivateRedis | PrivatePostgres, rng: random.Random) -> Fault:
        injected = time.monotonic()
        if not service.running:
            return Fault(kind, "nothing stopped", injected, injected, problem="the service was not running")
        service.stop()
        if service.running:
            problem = "the service was still running after it was stopped"
            return Fault(kind, "not stopped", injected, time.monotonic(), problem=problem)
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
            print(
                f"[{fault.injected - self.began:5.0f}s] fault {len(faults) + 1}: {fault.kind} ({fault.detail})",
                flush=True,
            )
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


def measure_recovery(faults: list[Fault], records: list[ClientRecord], samples) -> None:
    """For each fault: the first request that started after it was restored and was served whole
    (and how long after the restore it ended); when both replicas were ready again, if one went
    before the next fault."""
    served = sorted((r for r in records if r.outcome == COMPLETED), key=lambda r: r.started)
    for fault, following in zip(faults, [*faults[1:], None]):
        first = next((r for r in served if r.started >= fault.restored), None)
        fault.recovered_s = None if first is None else first.ended - fault.restored
        until = first.ended if first else float("inf")
        fault.server_errors = sum(
            1
            for r in records
            if fault.injected <= r.ended <= until
            and (r.outcome == STREAM_ERROR or (r.outcome == ERROR and r.status >= 500))
        )
        # A dip counts only before the next fault, whose own dip it would otherwise be.
        after = [(t, n) for t, n in samples if t >= fault.injected and (following is None or t < following.injected)]
        dip = next((i for i, (_, n) in enumerate(after) if n is not None and n < REPLICAS), None)
        if dip is not None:
            back = next((t for t, n in after[dip:] if n is not None and n >= REPLICAS), None)
            fault.replicas_whole_s = None if back is None else back - fault.injected


def fault_detail(fault: Fault) -> str:
    detail = fault.detail
    if fault.failed_seen_s is not None:
        detail += f"; recorded failed after {fault.failed_seen_s:.1f}s ({fault.failure_seen.split(':')[0]})"
    if fault.replaced_s is not None:
        detail += f", a new replica ready after {fault.replaced_s:.1f}s"
    return f"{detail}; NO EFFECT: {fault.problem}" if fault.problem else detail


def fault_problems(faults: list[Fault]) -> list[str]:
    return [f"fault {i} ({f.kind}): {f.problem}" for i, f in enumerate(faults, 1) if f.problem]


def report(
    args,
    records: list[ClientRecord],
    faults: list[Fault],
    result,
    settled: bool,
    began: float,
    started: float,
    elapsed: float,
) -> dict:
    outcomes = Counter(r.label for r in records)
    by_plan = Counter(r.plan for r in records)
    lines = [
        f"chaos run: {elapsed:.0f}s of traffic from {started - began:.0f}s, {args.tenants} tenants, "
        f"{args.concurrency} clients, seed {args.seed}, a fault every ~{args.fault_interval:.0f}s",
        f"requests: {len(records)} ({', '.join(f'{n} {plan}' for plan, n in sorted(by_plan.items()))})",
        "",
        "| outcome seen by the client | requests | what the ledger did |",
        "|---|---|---|",
    ]
    lines += [
        f"| {label} | {n} | {', '.join(f'{k} {v}' for k, v in sorted(result.ledger_by_outcome[label].items()))} |"
        for label, n in sorted(outcomes.items(), key=lambda kv: -kv[1])
    ]
    lines += [
        "",
        "| # | fault | detail | at (s) | served again after (s) | both replicas ready after (s) | 5xx seen meanwhile |",
        "|---|---|---|---|---|---|---|",
    ]

    def secs(value):
        return "-" if value is None else f"{value:.1f}"

    lines += [
        f"| {i} | {f.kind} | {fault_detail(f)} | {f.injected - began:.0f} | {secs(f.recovered_s)} | "
        f"{secs(f.replicas_whole_s)} | {f.server_errors} |"
        for i, f in enumerate(faults, 1)
    ]
    lines += [
        "",
        f"charged requests {result.charged} = ledger usage entries {result.ledger_usage_entries}; "
        f"recorded unbilled {result.recorded_unbilled}; released {result.released}; "
        f"every hold settled: {'yes' if settled else 'NO'}",
    ]
    for name in result.PROBLEMS:
        found = getattr(result, name)
        lines.append(f"{name.replace('_', ' ')}: {len(found)}" + "".join(f"\n    {item}" for item in found[:20]))
    lines.append(f"audit: {'OK' if result.ok and settled else 'FAILED'}")
    print("\n".join(lines), flush=True)
    return {
        "options": vars(args),
        "seconds": elapsed,
        "requests": len(records),
        "outcomes": dict(outcomes),
        "faults": [asdict(f) for f in faults],
        "settled": settled,
        "audit": result.to_json(),
        "table": "\n".join(lines),
    }


async def traffic_with_faults(
    chaos: Chaos, tenants: list[Tenant], args
) -> tuple[list[ClientRecord], list[Fault], float, float]:
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
    faults, _ = await asyncio.gather(
        chaos.inject_faults(until, random.Random(args.seed), args.fault_interval), traffic.run(args.duration)
    )
    return traffic.records, faults, started, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    faults = "\n".join(
        textwrap.fill(text, 100, initial_indent=f"  {kind}: ", subsequent_indent="    ")
        for kind, text in FAULT_HELP.items()
    )
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="faults: one at a time, every kind once per round in a seeded order; a fault that finds nothing to\n"
        f"act on, or whose effect is never seen, fails the run (its audit and exit status).\n{faults}",
    )
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
        result = audit(records, [t.name for t in tenants], fault_problems(faults))
        summary = report(args, records, faults, result, settled, chaos.began, started, elapsed)
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
