"""The `make run` launcher: brings the system up and takes every process down again."""

import io
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from controlplane.env import read_env_file
from controlplane.launcher import (
    Launcher,
    ProcessSpec,
    RestartPolicy,
    banner,
    build_parser,
    demo_environment,
    process_specs,
)

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _live_members_of_group(pgid: int) -> list[int]:
    """Processes (zombies excepted) whose process group is `pgid`, read from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            members.append(int(stat.parent.name))
    return members


def _embedded_env(tmp_path: Path) -> dict[str, str]:
    """What `make run` sees on a fresh machine: no DATABASE_URL, no REDIS_URL, state under VAR_DIR."""
    unset = ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "GPUSERVE_HOST", "DEBUG")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "VAR_DIR": str(tmp_path / "var")}


def test_process_specs_name_web_fleet_worker_beat_and_the_gpu_worker_daemon():
    specs = {spec.name: spec.argv for spec in process_specs(host="0.0.0.0", port=8000, fleet_port=8101)}
    assert list(specs) == ["web", "fleet", "worker", "beat", "gpuworker", "quality"]
    web, fleet, daemon = specs["web"], specs["fleet"], specs["gpuworker"]
    assert "controlplane.asgi:application" in web and web[web.index("--port") + 1] == "8000"
    # The daemon calls the fleet server, on this machine only, whatever address the web server opens.
    assert "controlplane.fleet_asgi:application" in fleet and fleet[fleet.index("--port") + 1] == "8101"
    assert fleet[fleet.index("--host") + 1] == "127.0.0.1"
    assert daemon[daemon.index("daemon") + 1 : daemon.index("daemon") + 3] == ["--control-url", "http://127.0.0.1:8101"]


def test_the_process_specs_need_no_django_set_up():
    """bench/embedded_storm.py names the children before Django is set up, as main() does."""
    code = "from controlplane.launcher import process_specs; print(len(process_specs(host='127.0.0.1', port=0)))"
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


def test_the_web_server_listens_on_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("GPUSERVE_HOST", raising=False)
    assert build_parser().parse_args([]).host == "127.0.0.1"
    assert build_parser().parse_args(["--host", "0.0.0.0"]).host == "0.0.0.0"
    monkeypatch.setenv("GPUSERVE_HOST", "::")
    assert build_parser().parse_args([]).host == "::"
    web = process_specs(host=build_parser().parse_args([]).host, port=8000)[0].argv
    assert web[web.index("--host") + 1] == "::"


@pytest.mark.django_db
def test_the_banner_names_each_login_with_what_it_can_do_and_points_at_the_dashboard(tmp_path):
    from django.core.management import call_command

    env_file = tmp_path / ".env.demo"
    call_command("seed_demo", env_file=env_file, stdout=io.StringIO())
    demo = read_env_file(env_file)
    text = banner(port=8123, env_file=env_file)
    lines = text.splitlines()
    assert "  dashboard: http://127.0.0.1:8123/" in lines
    assert "/admin/" not in text
    for username, password, does in (
        ("admin", demo["DEMO_ADMIN_PASSWORD"], "reports"),
        ("operator", demo["DEMO_OPERATOR_PASSWORD"], "runs the fleet"),
        ("member", demo["DEMO_MEMBER_PASSWORD"], "API keys"),
    ):
        [line] = [line for line in lines if f" {username} / {password} " in line]
        assert does in line
    assert f"OPENAI_API_KEY={demo['OPENAI_API_KEY']}" in text
    assert "http://127.0.0.1:8123/metrics" in text


def test_the_banner_without_a_seed_says_how_to_get_one(tmp_path):
    text = banner(port=8000, env_file=tmp_path / ".env.demo")
    assert "seed_demo" in text and "OPENAI_BASE_URL=http://127.0.0.1:8000/v1" in text


# Quick restarts so the tests do not wait; the crash loop is the policy's, not a timing.
FAST_RESTARTS = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, crash_loop_exits=3, window_s=600)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_child_is_restarted_with_its_forks_swept_and_the_others_left_running():
    out = io.StringIO()
    # The victim forks a grandchild (as Celery forks its pool), then waits to be killed.
    victim = [
        sys.executable,
        "-c",
        "import subprocess, time\n"
        "grandchild = subprocess.Popen(['sleep', '120'])\n"
        "print('up with grandchild', grandchild.pid, flush=True)\ntime.sleep(120)",
    ]
    launcher = Launcher(
        [ProcessSpec("steady", ["sleep", "120"]), ProcessSpec("victim", victim)], out=out, restart=FAST_RESTARTS
    )
    seen: dict[str, list[int]] = {"victims": [], "grandchildren": []}

    def kill_the_first_victim_then_stop() -> bool:
        log = out.getvalue()
        victims = [int(pid) for pid in re.findall(r"started victim \(pid (\d+)\)", log)]
        grandchildren = [int(pid) for pid in re.findall(r"up with grandchild (\d+)", log)]
        if len(victims) == 1 and len(grandchildren) == 1 and not seen["victims"]:
            seen.update(victims=victims, grandchildren=grandchildren)
            os.kill(victims[0], signal.SIGKILL)  # the process alone, as the OOM killer would
        elif len(grandchildren) == 2:  # the second victim is up
            launcher.request_stop(signal.SIGINT)
        return False

    assert launcher.run(on_ready=kill_the_first_victim_then_stop) == 0
    log = out.getvalue()
    first = seen["victims"][0]
    assert "victim exited unexpectedly with status -9 (SIGKILL); restarting it in 0.05s" in log, log
    assert re.search(r"restarted victim \(pid \d+\)", log), log
    # The first victim's fork went with it; the steady child was started once and never stopped.
    assert not _alive(seen["grandchildren"][0])
    assert not _live_members_of_group(first)
    assert log.count("started steady") == 1 and "steady exited" not in log


def test_a_job_that_runs_once_is_reported_when_it_ends_and_never_restarted():
    out = io.StringIO()
    launcher = Launcher(
        [ProcessSpec("steady", ["sleep", "120"]), ProcessSpec("job", ["sh", "-c", "echo measured; exit 3"], once=True)],
        out=out,
        restart=FAST_RESTARTS,
    )

    def stop_once_the_job_ended() -> bool:
        if "job finished" in out.getvalue():
            launcher.request_stop(signal.SIGINT)
        return False

    assert launcher.run(on_ready=stop_once_the_job_ended) == 0
    log = out.getvalue()
    assert re.search(r"^job +\| measured$", log, re.MULTILINE), log
    assert "job finished with status 3" in log and "restarted job" not in log and "job exited" not in log


def test_the_demos_quality_check_runs_once_for_smollm2_and_its_fp8_twin():
    [quality] = [spec for spec in process_specs(host="127.0.0.1", port=8000) if spec.name == "quality"]
    assert quality.once and "measure_quality" in quality.argv and "--unmeasured" in quality.argv
    assert quality.argv[-2:] == ["smollm2-135m-instruct", "smollm2-135m-instruct-fp8"]


def test_a_crash_loop_stops_everything_and_fails():
    out = io.StringIO()
    launcher = Launcher(
        [
            ProcessSpec("sleeper", ["sleep", "60"]),
            ProcessSpec("crasher", [sys.executable, "-c", "raise SystemExit(3)"]),
        ],
        out=out,
        restart=FAST_RESTARTS,
    )
    assert launcher.run() == 1
    log = out.getvalue()
    # Restarted twice with a doubling delay, then its third exit is a crash loop.
    assert "crasher exited unexpectedly with status 3; restarting it in 0.05s (exit 1 of 2" in log, log
    assert "crasher exited unexpectedly with status 3; restarting it in 0.1s (exit 2 of 2" in log, log
    assert "crasher exited with status 3: 3 exits within 600s, a crash loop; stopping everything" in log, log
    assert len(re.findall(r"started crasher \(pid \d+\)", log)) == 3
    pids = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", log)]
    assert not any(_live_members_of_group(pid) for pid in pids)


def test_the_restart_delay_doubles_up_to_its_cap():
    policy = RestartPolicy(first_delay_s=1, max_delay_s=30)
    assert [policy.delay_s(exits) for exits in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_stop_request_stops_every_child():
    out = io.StringIO()
    launcher = Launcher([ProcessSpec("a", ["sleep", "60"]), ProcessSpec("b", ["sleep", "60"])], out=out)
    polls = []

    def stop_soon() -> bool:  # the readiness hook doubles as "the system is up; now press Ctrl-C"
        polls.append(1)
        if len(polls) == 3:
            launcher.request_stop(signal.SIGINT)
        return False

    assert launcher.run(on_ready=stop_soon) == 0
    pids = [int(pid) for pid in re.findall(r"started \w+ \(pid (\d+)\)", out.getvalue())]
    assert len(pids) == 2 and not any(_live_members_of_group(pid) for pid in pids)


def test_each_child_gets_its_own_stop_grace():
    # The GPU worker daemon drains its replicas on SIGTERM: a child that takes its time to stop
    # cleanly is waited for as long as its spec says, and only a child past its grace is killed.
    out = io.StringIO()

    def slow_stop(seconds: float) -> list[str]:  # exits cleanly that long after SIGTERM
        return [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, lambda *_: (time.sleep({seconds}), sys.exit(0)))\n"
            "print('ready', flush=True)\ntime.sleep(120)",
        ]

    launcher = Launcher(
        [
            ProcessSpec("patient", slow_stop(1.0), stop_grace_s=60.0),
            ProcessSpec("hasty", slow_stop(60.0), stop_grace_s=0.2),
        ],
        out=out,
    )

    def stop_when_both_ready() -> bool:
        if out.getvalue().count("ready") == 2:
            launcher.request_stop(signal.SIGINT)
        return False

    assert launcher.run(on_ready=stop_when_both_ready) == 0
    log = out.getvalue()
    assert "hasty did not stop within 0s; killing it" in log
    assert "patient did not stop" not in log


def test_the_gpu_worker_daemon_may_drain_and_stop_its_replicas_before_it_is_killed():
    # The daemon's stop: its consumer's warm shutdown, the replicas' drain, then their stop.
    from gpuworker.daemon.supervisor import KILL_AFTER_S
    from gpuworker.daemon.tasks import CONSUMER_STOP_S

    spec = next(spec for spec in process_specs(host="127.0.0.1", port=8000) if spec.name == "gpuworker")
    drain_s = float(spec.argv[spec.argv.index("--drain-timeout") + 1])
    assert spec.stop_grace_s > CONSUMER_STOP_S + drain_s + KILL_AFTER_S


@pytest.mark.slow
def test_make_run_serves_the_login_page_and_stops_cleanly_on_ctrl_c(tmp_path):
    env = _embedded_env(tmp_path)
    env_file = tmp_path / ".env.demo"
    for command in (["migrate", "--noinput"], ["seed_demo", "--env-file", str(env_file)]):
        subprocess.run(
            [sys.executable, "manage.py", *command], cwd=REPO, env=env, check=True, capture_output=True, timeout=300
        )
    port = _free_port()
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controlplane.launcher",
                "--port",
                str(port),
                "--fleet-port",
                str(_free_port()),
                "--env-file",
                str(env_file),
            ],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            login = _wait_for_page(f"http://127.0.0.1:{port}/accounts/login/", launcher, log_path)
            assert 'name="password"' in login
            # DEBUG is off for the children (launcher.demo_environment): a missing page is the
            # dashboard's 404, not the debug page listing every route; /static/ is still served.
            status, _, missing = _get(f"http://127.0.0.1:{port}/no-such-page/")
            assert status == 404 and 'data-status="404"' in missing and "URLconf" not in missing
            assert _get(f"http://127.0.0.1:{port}/static/css/app.css")[0] == 200
            _wait_for_text(log_path, "Press Ctrl-C to stop", launcher)
            # Not told otherwise, it listens on this machine only.
            _wait_for_text(log_path, f"Uvicorn running on http://127.0.0.1:{port}", launcher)
            # The demo model goes through the fleet's own path: reconcile places it on the local
            # daemon, which loads it and reports its endpoint.
            database = tmp_path / "var" / "db.sqlite3"
            endpoint = _wait_for_ready_replica(database, "demo-tiny", launcher, log_path)
            token = (tmp_path / "var" / "worker-token").read_text().strip()
            health = urllib.request.Request(f"{endpoint}/health", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(health, timeout=5) as response:
                assert json.loads(response.read())["status"] == "ready"
            # The real chat model (a GGUF file, dequantised at load) answers through the gateway.
            _wait_for_ready_replica(database, "smollm2-135m-instruct", launcher, log_path, timeout=400)
            import openai

            demo = read_env_file(env_file)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key=demo["OPENAI_API_KEY"], max_retries=0, timeout=300
            )
            reply = client.chat.completions.create(
                model="smollm2-135m-instruct",
                temperature=0,
                max_tokens=24,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
            )
            assert "Paris" in reply.choices[0].message.content
            # The quality check ran once in the background: SmolLM2 and its FP8-at-load twin measured
            # by the local worker, the figures on their catalog rows.
            measured = _wait_for_perplexities(
                database, ["smollm2-135m-instruct", "smollm2-135m-instruct-fp8"], launcher, log_path
            )
            assert all(1 < perplexity < 1000 for perplexity in measured.values()), measured
            assert measured["smollm2-135m-instruct-fp8"] != measured["smollm2-135m-instruct"]
            # At idle the log stays readable: heartbeats and beat's checks (each a second) are at
            # DEBUG, so a quiet half minute adds at most a line per ten seconds.
            _wait_for_quiet_log(log_path, launcher, seconds=30, most_lines=3)
            launcher.send_signal(signal.SIGINT)
            assert launcher.wait(timeout=60) == 0
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    output = log_path.read_text()
    pids = {name: int(pid) for name, pid in re.findall(r"started (\w+) \(pid (\d+)\)", output)}
    assert set(pids) == {"web", "fleet", "worker", "beat", "gpuworker", "quality"}
    assert "quality finished with status 0" in output
    leftovers = {name: _live_members_of_group(pid) for name, pid in pids.items()}
    assert not any(leftovers.values()), leftovers
    # The banner gives the URL, the logins and the API key that seed_demo wrote.
    demo = read_env_file(env_file)
    assert f"http://127.0.0.1:{port}/" in output
    assert demo["OPENAI_API_KEY"] in output
    assert all(demo[f"DEMO_{role}_PASSWORD"] in output for role in ("ADMIN", "OPERATOR", "MEMBER"))
    assert "random noise" in output
    assert "all processes stopped" in output


def _get(url: str) -> tuple[int, dict, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_the_demos_web_server_answers_a_missing_page_with_the_dashboards_404_and_serves_static_files(tmp_path):
    env = _embedded_env(tmp_path)
    env.update(demo_environment(var_dir=tmp_path / "var"), GPUSERVE_WORKER_TOKEN="demo-environment-test-token")
    assert env["SECRET_KEY"] == demo_environment(var_dir=tmp_path / "var")["SECRET_KEY"]  # kept across runs
    port = _free_port()
    web = process_specs(host="127.0.0.1", port=port, var_dir=tmp_path / "var")[0]
    log_path = tmp_path / "web.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(web.argv, cwd=REPO, env={**env, **web.env}, stdout=log, stderr=subprocess.STDOUT)
        try:
            assert 'name="password"' in _wait_for_page(f"http://127.0.0.1:{port}/accounts/login/", server, log_path)
            status, headers, page = _get(f"http://127.0.0.1:{port}/no-such-page/")
            assert status == 404 and 'data-status="404"' in page
            assert "URLconf" not in page and "controlplane.urls" not in page
            status, _, css = _get(f"http://127.0.0.1:{port}/static/css/app.css")
            assert status == 200 and ".topbar" in css
            # Plain HTTP on this machine: no redirect to HTTPS, cookies a browser sends over HTTP.
            status, headers, _ = _get(f"http://127.0.0.1:{port}/accounts/login/")
            assert status == 200 and "secure" not in headers.get("Set-Cookie", "").lower()
        finally:
            server.terminate()
            server.wait(timeout=30)


def _wait_for_quiet_log(log_path: Path, launcher: subprocess.Popen, *, seconds: float, most_lines: int) -> None:
    """Fails unless some `seconds`-long stretch of the log (within five tries, so a replica's late
    start-up lines do not count) adds at most `most_lines` lines."""
    for _ in range(5):
        before = len(log_path.read_text().splitlines())
        time.sleep(seconds)
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited early ({launcher.returncode}):\n{log_path.read_text()}")
        added = log_path.read_text().splitlines()[before:]
        if len(added) <= most_lines:
            return
    pytest.fail(f"{len(added)} lines in {seconds:.0f}s of idle time:\n" + "\n".join(added))


def _wait_for_ready_replica(
    database: Path, model: str, launcher: subprocess.Popen, log_path: Path, timeout: float = 120
) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited early ({launcher.returncode}):\n{log_path.read_text()}")
        with sqlite3.connect(database, timeout=20) as db:
            row = db.execute(
                "SELECT r.endpoint_url FROM fleet_replica r "
                "JOIN catalog_deployment d ON r.deployment_id = d.id "
                "JOIN catalog_model m ON d.model_id = m.id "
                "WHERE r.state = 'ready' AND m.public_name = ?",
                (model,),
            ).fetchone()
        if row:
            return row[0]
        time.sleep(0.5)
    pytest.fail(f"the demo model {model} was not ready within {timeout}s:\n{log_path.read_text()}")


def _wait_for_perplexities(
    database: Path, models: list[str], launcher: subprocess.Popen, log_path: Path, timeout: float = 900
) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited early ({launcher.returncode}):\n{log_path.read_text()}")
        with sqlite3.connect(database, timeout=20) as db:
            rows = db.execute(
                f"SELECT public_name, perplexity FROM catalog_model WHERE perplexity IS NOT NULL "
                f"AND public_name IN ({', '.join('?' * len(models))})",
                models,
            ).fetchall()
        if len(rows) == len(models):
            return dict(rows)
        time.sleep(1)
    pytest.fail(f"{models} were not all measured within {timeout}s:\n{log_path.read_text()}")


def _wait_for_page(url: str, launcher: subprocess.Popen, log_path: Path, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited early ({launcher.returncode}):\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.read().decode()
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.3)
    pytest.fail(f"{url} did not answer within {timeout}s:\n{log_path.read_text()}")


def _wait_for_text(log_path: Path, text: str, launcher: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text():
        if time.monotonic() > deadline or launcher.poll() is not None:
            pytest.fail(f"{text!r} never appeared:\n{log_path.read_text()}")
        time.sleep(0.2)
