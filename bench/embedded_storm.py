"""A storm on the embedded default (`make run`): fleet tasks, scale actions and /v1 requests for
--duration seconds while the Celery worker is SIGKILLed once midway (or the children and replicas
--kill names); then every process must be alive and nothing lost.

    python -m bench.embedded_storm [--duration 600] [--scale-interval 4] [--concurrency 2]
                                  [--kill worker[,gpuworker][,replica...]] [--seed 0] [--json report.json]

It runs `python -m controlplane.launcher` as `make run` does (no DATABASE_URL, no REDIS_URL: SQLite
and the SQLite broker under a fresh VAR_DIR, a free port). This process migrates that VAR_DIR's
database and seeds it through the services (three tiny random checkpoints, one deployment each,
autoscaling off, a tenant with a key), then, against the running system:
- scales a random deployment to another size every --scale-interval seconds (deployment_scale, the
  service behind the dashboard's scale form; storm-a stays between 1 and 2 replicas so it can serve,
  storm-b and storm-c go between 0 and 1);
- asks for a reconcile of every deployment each second (the fleet task a scale sends);
- sends /v1/completions for storm-a from --concurrency clients;
- at half time SIGKILLs the Celery worker (its main process, as the OOM killer would); with
  `--kill worker,gpuworker` the GPU worker daemon too, the kills spread evenly over the run;
- each `replica` in --kill SIGKILLs a ready storm-a replica's process, found by the pid the daemon
  reports in its heartbeats and signalled only while it is the daemon's child (bench/replica_faults.py,
  as bench/chaos.py does), once the fleet is settled; the storm's actions pause until the control
  plane records the replica failed, a new one is ready and a request is served after that. A replica
  kill that finds nothing to kill, or whose failure or replacement is never seen, fails the run.
After --duration it stops acting and waits for the fleet to settle (every deployment's ready
replicas equal to its desired, none pending, loading or draining), then accounts for every message
sent to the GPU worker daemon: each replica placed is one load message and each stopped one an
unload message; the daemon logs each it takes ("accepted ..."). One not taken must have been healed:
a load by reconcile (the replica failed as not acknowledged and placed again, or stopped before it
loaded), an unload by the daemon's heartbeat (the control plane answers it with the replicas to
stop). The exit status is 0 only when every process is alive, each killed child came back once and
a load placed after its restart reached the daemon, each replica kill acted, no other child exited,
nothing was lost and the fleet settled; the launcher is then stopped with Ctrl-C (SIGINT) and must exit 0.
`tests/integration/test_embedded_storm.py` runs a short one in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.replica_faults import alive, is_child, kill_replica, poll, replica_processes  # noqa: E402
from controlplane.launcher import process_specs  # noqa: E402
from tests.private_services import free_port  # noqa: E402

# The launcher's children, by the names it starts them under (one more process is one more line there).
# The children that run for the system's life (a run-once job, such as the demo's quality check, ends).
CHILDREN = tuple(spec.name for spec in process_specs(host="127.0.0.1", port=0) if not spec.once)
REPLICA = "replica"  # --kill's name for a replica's process
# (model, min replicas, max replicas, replicas at the start)
DEPLOYMENTS = (("storm-a", 1, 2, 1), ("storm-b", 0, 1, 1), ("storm-c", 0, 1, 0))
TRAFFIC_MODEL = "storm-a"
SETTLE_TIMEOUT_S = 300
STARTUP_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120
# A replica kill waits this long for the fleet to settle with a storm-a replica whose process the
# daemon reports, then for the control plane to record it failed, for a new replica to be ready, and
# for a request to be served after that.
REPLICA_TARGET_WAIT_S = 180
REPLICA_FAILED_WAIT_S = 60
REPLICA_REPLACED_WAIT_S = 180
SERVED_AGAIN_WAIT_S = 120


@dataclass
class Traffic:
    outcomes: Counter = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)


class Storm:
    def __init__(self, scratch: Path, *, seed: int):
        self.scratch = scratch
        self.var_dir = scratch / "var"
        self.port = free_port()
        self.log_path = scratch / "launcher.log"
        self.rng = random.Random(seed)
        self.began = time.monotonic()
        self.launcher: subprocess.Popen | None = None
        self.scale_actions = 0
        self.scale_refused = 0
        self.reconcile_requests = 0
        self.kills: list[dict] = []
        self.traffic: Traffic | None = None

    # --- the system ----------------------------------------------------------------------------

    def environment(self) -> dict[str, str]:
        """What `make run` sees on a fresh machine: no DATABASE_URL or REDIS_URL, state under VAR_DIR."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "GPUSERVE_HOST", "GPUSERVE_WORKER_TOKEN")
        }
        return {
            **env,
            "DEBUG": "1",
            "VAR_DIR": str(self.var_dir),
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "PYTHONPATH": str(REPO),
        }

    def prepare(self) -> str:
        """Migrate and seed this VAR_DIR from this process; returns the tenant's API key."""
        env = self.environment()
        os.environ.clear()
        os.environ.update(env)
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from controlplane.accounts.services import api_key_create, tenant_create
        from controlplane.billing.services import credit_grant, plan_create, price_tier_create
        from controlplane.catalog.services import model_create
        from controlplane.fleet.services.deployments import deployment_create
        from gpuworker.demo_model import write_demo_model

        tier = price_tier_create(
            name="storm", price_per_request=Decimal("0.001"), reference_price_per_million_tokens=Decimal("0.5")
        )
        for i, (name, low, high, start) in enumerate(DEPLOYMENTS):
            checkpoint = write_demo_model(self.var_dir / "models" / name, max_position_embeddings=256, seed=i)
            model_create(
                public_name=name,
                family="llama",
                kind="chat",
                weights_path=str(checkpoint),
                context_length=256,
                parameter_count=4_000_000,
                price_tier=tier,
            )
            deployment_create(
                model_name=name, desired_replicas=start, min_replicas=low, max_replicas=high, autoscale=False
            )
        plan = plan_create(
            name="storm", included_requests_per_month=0, rate_limit_per_minute=100_000, max_concurrent_requests=64
        )
        tenant = tenant_create(name="storm", plan=plan)
        credit_grant(tenant=tenant, amount=Decimal("1000"), memo="storm")
        return api_key_create(tenant=tenant, name="storm").plaintext

    def start(self) -> None:
        log = open(self.log_path, "w")
        self.launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controlplane.launcher",
                "--port",
                str(self.port),
                "--env-file",
                str(self.scratch / ".env.demo"),
            ],
            cwd=REPO,
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.wait_until(lambda: "Press Ctrl-C to stop everything" in self.log(), STARTUP_TIMEOUT_S, "the banner")
        self.wait_until(self.settled, STARTUP_TIMEOUT_S, "the first replicas")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> dict[str, list[int]]:
        """Each child's pids, in start order, from the launcher's lines."""
        found: dict[str, list[int]] = {name: [] for name in CHILDREN}
        for name, pid in re.findall(r"^launcher\s*\| (?:re)?started (\w+) \(pid (\d+)\)", self.log(), re.M):
            if name in found:  # not a run-once job
                found[name].append(int(pid))
        return found

    def wait_until(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if self.launcher is not None and self.launcher.poll() is not None:
                raise RuntimeError(
                    f"the launcher exited ({self.launcher.returncode}) waiting for {what}:\n" + self.log()[-6000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}:\n" + self.log()[-6000:])
            time.sleep(0.5)

    def settled(self) -> bool:
        """Every deployment has its desired replicas ready, and no replica is on its way anywhere."""
        from django.db import close_old_connections

        from controlplane.catalog.models import Deployment
        from controlplane.fleet.models import Replica

        close_old_connections()
        State = Replica.State
        if Replica.objects.filter(state__in=(State.PENDING, State.LOADING, State.DRAINING)).exists():
            return False
        return all(d.replicas.filter(state=State.READY).count() == d.desired_replicas for d in Deployment.objects.all())

    # --- the load ------------------------------------------------------------------------------

    def scale_once(self) -> None:
        from django.core.exceptions import ValidationError

        from controlplane.catalog.models import Deployment
        from controlplane.fleet.services.deployments import deployment_scale

        deployment = self.rng.choice(list(Deployment.objects.select_related("model").order_by("pk")))
        sizes = [
            n for n in range(deployment.min_replicas, deployment.max_replicas + 1) if n != deployment.desired_replicas
        ]
        try:
            deployment_scale(deployment=deployment, desired_replicas=self.rng.choice(sizes))
            self.scale_actions += 1
        except ValidationError:  # a concurrent change moved its bounds: the dashboard would say so
            self.scale_refused += 1

    def request_reconcile(self) -> None:
        from django.db import transaction

        from controlplane.catalog.models import Deployment
        from controlplane.fleet import commands

        with transaction.atomic():  # sent on commit, as the services send it
            commands.request_reconcile(deployment_ids=list(Deployment.objects.values_list("pk", flat=True)))
        self.reconcile_requests += 1

    def send_traffic(self, key: str, concurrency: int) -> tuple[Traffic, list[threading.Thread]]:
        import httpx

        traffic = Traffic()
        url = f"http://127.0.0.1:{self.port}/v1/completions"

        def client(i: int) -> None:
            with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
                while not traffic.stop.is_set():
                    try:
                        answer = http.post(
                            url,
                            json={"model": TRAFFIC_MODEL, "prompt": f"storm {i}", "max_tokens": 8, "temperature": 0},
                        )
                        traffic.outcomes[str(answer.status_code)] += 1
                    except httpx.HTTPError as exc:
                        traffic.outcomes[type(exc).__name__] += 1
                        time.sleep(0.5)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
        for thread in threads:
            thread.start()
        return traffic, threads

    def kill_child(self, name: str) -> None:
        pid = self.pids()[name][-1]
        os.kill(pid, signal.SIGKILL)
        kill = {"child": name, "pid": pid, "at_s": time.monotonic() - self.began}
        self.kills.append(kill)

        def back() -> int | None:
            pids = self.pids()[name]
            return pids[-1] if pids[-1] != pid else None

        kill["new_pid"] = self.wait_until(back, 120, f"{name}'s restart")
        kill["back_after_s"] = time.monotonic() - self.began - kill["at_s"]
        kill["restarted_wall"] = time.time()

    def daemons(self) -> dict[str, int]:
        """The GPU worker daemon's worker name and pid, from the launcher's lines, while it runs as the
        launcher's child (none otherwise)."""
        [spec] = [spec for spec in process_specs(host="127.0.0.1", port=self.port) if spec.name == "gpuworker"]
        started = self.pids()["gpuworker"]
        if not started or self.launcher is None or not is_child(started[-1], self.launcher.pid):
            return {}
        return {spec.argv[spec.argv.index("--name") + 1]: started[-1]}

    def kill_replica(self) -> None:
        """SIGKILL a ready replica of the traffic model (bench/replica_faults.py), once the fleet is settled so
        the kill is healed by a replacement, not by a scale action; record what the control plane saw."""
        from controlplane.catalog.models import Deployment

        kill = {"child": REPLICA, "at_s": time.monotonic() - self.began}
        self.kills.append(kill)
        deployment_id = Deployment.objects.get(model__public_name=TRAFFIC_MODEL).pk
        targets = []

        def found() -> bool:
            targets[:] = []  # a look that fails finds nothing, never what an earlier look found
            if self.settled():
                targets.extend(replica_processes(deployment_ids=[deployment_id], daemons=self.daemons()))
            return bool(targets)

        if not poll(found, REPLICA_TARGET_WAIT_S):
            kill["problem"] = (
                f"no ready {TRAFFIC_MODEL} replica with a live process the daemon reported, in a "
                f"settled fleet, within {REPLICA_TARGET_WAIT_S}s"
            )
            return
        target = self.rng.choice(targets)
        done = kill_replica(target, failed_wait_s=REPLICA_FAILED_WAIT_S, replaced_wait_s=REPLICA_REPLACED_WAIT_S)
        kill.update(
            at_s=done.killed_at - self.began,
            killed=done.killed,
            replica_id=target.replica_id,
            pid=target.pid,
            of=len(targets),
            failure_seen=done.failure_seen,
            failed_seen_s=done.failed_seen_s,
            replaced_by=done.replaced_by,
            replaced_s=done.replaced_s,
            problem=done.problem,
        )
        if done.problem:
            return
        served = self.traffic.outcomes["200"]
        if poll(lambda: self.traffic.outcomes["200"] > served, SERVED_AGAIN_WAIT_S):
            kill["served_again_s"] = time.monotonic() - done.killed_at
        else:
            kill["problem"] = f"no request was served within {SERVED_AGAIN_WAIT_S}s of the new replica being ready"

    def run(self, *, duration: float, scale_interval: float, concurrency: int, key: str, kill: list[str]) -> Traffic:
        traffic, clients = self.send_traffic(key, concurrency)
        self.traffic = traffic
        started = time.monotonic()
        next_scale = started
        kills = [(started + duration * (i + 1) / (len(kill) + 1), name) for i, name in enumerate(kill)]
        while (now := time.monotonic()) < started + duration:
            if kills and now >= kills[0][0]:
                name = kills.pop(0)[1]
                if name == REPLICA:
                    self.kill_replica()
                else:
                    self.kill_child(name)
            if now >= next_scale:
                self.scale_once()
                next_scale = now + scale_interval
            self.request_reconcile()
            if self.launcher.poll() is not None:
                break
            time.sleep(1.0)
        traffic.stop.set()
        for thread in clients:
            thread.join(timeout=150)
        return traffic

    # --- the account -----------------------------------------------------------------------------

    def account(self) -> dict:
        from django.db import close_old_connections

        from controlplane.fleet.models import Replica

        close_old_connections()
        log = self.log()
        taken_loads = {int(n) for n in re.findall(r"accepted LoadModel\(replica_id=(\d+)", log)}
        taken_unloads = {int(n) for n in re.findall(r"accepted UnloadModel\(replica_id=(\d+)", log)}
        replicas = list(Replica.objects.all())
        State = Replica.State
        loads = {"sent": len(replicas), "taken": 0, "healed": 0, "lost": 0}
        unloads = {"sent": 0, "taken": 0, "healed": 0, "lost": 0}
        lost_ids = []
        for replica in replicas:
            if replica.pk in taken_loads:
                loads["taken"] += 1
            elif replica.state in (State.FAILED, State.STOPPED):
                # The fleet noticed (not acknowledged, its worker lost) and placed another, or it was
                # no longer wanted before it loaded.
                loads["healed"] += 1
            else:
                loads["lost"] += 1
                lost_ids.append(replica.pk)
            if replica.state == State.STOPPED:
                unloads["sent"] += 1
                unloads["taken" if replica.pk in taken_unloads else "healed"] += 1
        unloads["lost"] = Replica.objects.filter(state=State.DRAINING).count()
        for kill in (k for k in self.kills if k["child"] != REPLICA):
            kill["loads_taken_after_restart"] = sum(
                1 for r in replicas if r.pk in taken_loads and r.created_at.timestamp() > kill["restarted_wall"]
            )
        tracebacks = Counter(re.findall(r"^(\w+)\s*\| Traceback \(most recent call last\)", log, re.M))
        return {
            "loads": loads,
            "unloads": unloads,
            "lost_replica_ids": lost_ids,
            "failures": dict(Counter(r.failure for r in replicas if r.state == State.FAILED)),
            "tracebacks": dict(tracebacks),
            "json_decode_errors": log.count("JSONDecodeError"),
        }

    def processes(self) -> dict:
        pids = self.pids()
        exits = re.findall(r"^launcher\s*\| (\w+) exited (?:unexpectedly )?with (status [^;:]+)", self.log(), re.M)
        return {
            name: {
                "pid": found[-1] if found else None,
                "alive": bool(found) and alive(found[-1]),
                "starts": len(found),
                "exits": [status for who, status in exits if who == name],
            }
            for name, found in pids.items()
        }

    def stop(self) -> int | None:
        if self.launcher is None or self.launcher.poll() is not None:
            return self.launcher.returncode if self.launcher else None
        self.launcher.send_signal(signal.SIGINT)
        try:
            return self.launcher.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            self.launcher.wait()
            return None


def kill_line(kill: dict) -> str:
    if kill["child"] != REPLICA:
        return (
            f"{kill['child']} pid {kill['pid']} SIGKILLed at {kill['at_s']:.0f}s; back as pid {kill['new_pid']} "
            f"{kill['back_after_s']:.1f}s later; {kill['loads_taken_after_restart']} load(s) placed after its "
            "restart reached the daemon"
        )
    if not kill.get("killed"):
        return f"replica kill at {kill['at_s']:.0f}s: nothing killed; NO EFFECT: {kill['problem']}"
    line = (
        f"replica {kill['replica_id']} ({TRAFFIC_MODEL}, 1 of {kill['of']} ready) pid {kill['pid']} SIGKILLed at "
        f"{kill['at_s']:.0f}s"
    )
    if kill["failed_seen_s"] is not None:
        line += f"; recorded failed after {kill['failed_seen_s']:.1f}s ({kill['failure_seen'].split(';')[0]})"
    if kill["replaced_s"] is not None:
        line += f"; replica {kill['replaced_by']} ready after {kill['replaced_s']:.1f}s"
    if kill.get("served_again_s") is not None:
        line += f"; a request served again after {kill['served_again_s']:.1f}s"
    return line + (f"; NO EFFECT: {kill['problem']}" if kill["problem"] else "")


def judge(report: dict, kill: list[str], *, settled: bool) -> list[str]:
    """Why the storm failed (nothing: it passed)."""
    problems = []
    if "processes" not in report:
        problems.append(f"the storm did not finish: {report.get('error', 'see above')}")
    else:
        processes, account = report["processes"], report["account"]
        children = [name for name in kill if name != REPLICA]
        problems += [f"{name} is not alive" for name, row in processes.items() if not row["alive"]]
        problems += [
            f"{name} exited ({', '.join(row['exits'])})"
            for name, row in processes.items()
            if name not in children and row["exits"]
        ]
        problems += [
            f"{name} should have exited once and started twice: {processes[name]}"
            for name in children
            if len(processes[name]["exits"]) != 1 or processes[name]["starts"] != 2
        ]
        if len(report["kills"]) != len(kill):
            problems.append(f"{len(report['kills'])} of {len(kill)} kills were made")
        if account["loads"]["lost"] or account["unloads"]["lost"]:
            problems.append(f"messages lost: loads {account['loads']}, unloads {account['unloads']}")
        problems += [
            f"no load placed after {k['child']}'s restart reached the daemon"
            for k in report["kills"]
            if k["child"] != REPLICA and not k["loads_taken_after_restart"]
        ]
        problems += [
            f"replica kill at {k['at_s']:.0f}s: {k['problem']}"
            for k in report["kills"]
            if k["child"] == REPLICA and k["problem"]
        ]
        if not settled:
            problems.append("the fleet did not settle")
        if account["json_decode_errors"]:
            problems.append("a JSONDecodeError in the log")
    if report["launcher_exit"] != 0:
        problems.append(f"the launcher's exit status was {report['launcher_exit']}, not 0 after Ctrl-C")
    return problems


def table(report: dict) -> str:
    p, a, t = report["processes"], report["account"], report["traffic"]
    lines = [
        f"embedded storm: {report['duration_s']:.0f}s, {report['scale_actions']} scale actions "
        f"({report['scale_refused']} refused), {report['reconcile_requests']} reconcile requests, "
        f"settled {report['settle_s']:.1f}s after the end",
        "",
        f"{'process':<10} {'alive':>5} {'starts':>6}  exits",
    ]
    lines += [
        f"{name:<10} {str(row['alive']):>5} {row['starts']:>6}  {', '.join(row['exits']) or '-'}"
        for name, row in p.items()
    ]
    lines += [""] + [kill_line(kill) for kill in report["kills"]]
    lines += ["", f"{'to the daemon':<14} {'sent':>6} {'taken':>6} {'healed':>7} {'lost':>5}"]
    lines += [
        f"{kind:<14} {row['sent']:>6} {row['taken']:>6} {row['healed']:>7} {row['lost']:>5}"
        for kind, row in (("load_model", a["loads"]), ("unload_model", a["unloads"]))
    ]
    lines += [
        "",
        f"replicas failed: {a['failures'] or 'none'}; tracebacks in the log, by process: "
        f"{a['tracebacks'] or 'none'} (JSONDecodeError: {a['json_decode_errors']})",
        f"/v1/completions ({TRAFFIC_MODEL}): " + ", ".join(f"{k}: {v}" for k, v in sorted(t.items())),
        f"launcher stopped with Ctrl-C: exit {report['launcher_exit']}",
        "verdict: " + ("PASS" if report["ok"] else "FAIL: " + "; ".join(report["problems"])),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--scale-interval", type=float, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--kill",
        default="worker",
        help="what to SIGKILL, spread over the run (comma-separated; default: worker): "
        f"children ({', '.join(CHILDREN)}) once each, `{REPLICA}` (a replica's process) "
        "as often as named",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (VAR_DIR, the launcher's log)")
    args = parser.parse_args(argv)
    kill = [name for name in args.kill.split(",") if name]
    if unknown := set(kill) - {*CHILDREN, REPLICA}:
        parser.error(f"--kill names {sorted(unknown)}; it takes {', '.join(CHILDREN)} and {REPLICA}")
    if twice := sorted(name for name, n in Counter(kill).items() if n > 1 and name != REPLICA):
        parser.error(f"--kill names {', '.join(twice)} more than once; a child is killed once per run")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the table

    scratch = Path(tempfile.mkdtemp(prefix="embedded-storm-"))
    storm = Storm(scratch, seed=args.seed)
    report: dict = {"scratch": str(scratch)}
    try:
        key = storm.prepare()
        storm.start()
        print(
            f"system up after {time.monotonic() - storm.began:.0f}s (port {storm.port}, VAR_DIR {storm.var_dir})",
            flush=True,
        )
        traffic = storm.run(
            duration=args.duration, scale_interval=args.scale_interval, concurrency=args.concurrency, key=key, kill=kill
        )
        ended = time.monotonic()
        settled = True
        try:
            storm.wait_until(storm.settled, SETTLE_TIMEOUT_S, "the fleet to settle")
        except RuntimeError as exc:
            settled = False
            print(exc, file=sys.stderr)
        report.update(
            duration_s=args.duration,
            scale_actions=storm.scale_actions,
            scale_refused=storm.scale_refused,
            reconcile_requests=storm.reconcile_requests,
            settle_s=time.monotonic() - ended,
            account=storm.account(),
            kills=storm.kills,
            processes=storm.processes(),
            traffic=dict(traffic.outcomes),
        )
    except RuntimeError as exc:  # the system did not come up, or the launcher exited under the storm
        print(exc, file=sys.stderr)
        report["error"] = str(exc).splitlines()[0]
    finally:
        report["launcher_exit"] = storm.stop()
    problems = judge(report, kill, settled=settled)
    report.update(ok=not problems, problems=problems)
    if "processes" in report:
        report["table"] = table(report)
        print(report["table"], flush=True)
    else:
        print("FAIL:", "; ".join(problems), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    if not args.keep and report["ok"]:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    else:
        print(f"scratch kept: {scratch}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
