"""The operator pages by role, and what the fleet page shows: workers with their GPUs' live
figures, replicas with load progress, deployments, and the empty state; its live parts drawn in
one place, and fetched over HTTP while its WebSocket is down."""

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.accounts.models import User
from controlplane.fleet.models import Replica
from controlplane.fleet.services.autoscaling import deployments_autoscale
from tests.controlplane.dashboard.ops_support import (  # noqa: F401 (fixtures)
    _private_live_cache,
    beat,
    make_user,
    make_worker,
)
from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, ReplicaFactory, TenantFactory

pytestmark = pytest.mark.django_db

PAGES = ["dashboard:fleet", "dashboard:fleet_live", "dashboard:catalog", "dashboard:audit", "dashboard:catalog_add"]
ROOT = Path(__file__).resolve().parents[3]
OPS_TEMPLATES = ROOT / "templates" / "dashboard" / "ops"
# The fleet page's live parts, and the answers of its forms and buttons.
LIVE_TEMPLATES = (
    "_deployments.html",
    "_deployment.html",
    "_deployment_status.html",
    "_autoscale.html",
    "_workers.html",
    "_worker.html",
    "_heartbeat.html",
)
ANSWER_TEMPLATES = ("_scale_form.html", "_limits_form.html", "_answer.html", "_load_form.html")


@pytest.mark.parametrize("name", PAGES)
def test_anonymous_visitors_are_sent_to_login(client, name):
    response = client.get(reverse(name))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("name", PAGES)
def test_tenant_members_get_403(client, name):
    client.force_login(make_user(User.Role.TENANT_MEMBER))
    assert client.get(reverse(name)).status_code == 403


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
@pytest.mark.parametrize("name", PAGES)
def test_operators_and_admins_open_every_page(client, role, name):
    client.force_login(make_user(role))
    assert client.get(reverse(name)).status_code == 200


def test_tenant_members_cannot_act_either(client):
    deployment = DeploymentFactory()
    worker = make_worker()
    replica = ReplicaFactory(deployment=deployment, worker=worker)
    client.force_login(make_user(User.Role.TENANT_MEMBER))
    posts = [
        (reverse("dashboard:deployment_scale", args=[deployment.pk]), {f"s{deployment.pk}-desired_replicas": "2"}),
        (reverse("dashboard:deployment_edit", args=[deployment.pk]), {}),
        (reverse("dashboard:deployment_retry", args=[deployment.pk]), {}),
        (reverse("dashboard:replica_load"), {}),
        (reverse("dashboard:replica_unload", args=[replica.pk]), {}),
        (reverse("dashboard:worker_drain", args=[worker.pk]), {}),
        (reverse("dashboard:catalog_set_enabled", args=[deployment.model.pk]), {"enabled": "0"}),
        (reverse("dashboard:catalog_deploy", args=[deployment.model.pk]), {}),
    ]
    for url, data in posts:
        assert client.post(url, data).status_code == 403, url
    deployment.refresh_from_db()
    worker.refresh_from_db()
    assert (deployment.desired_replicas, worker.state) == (1, "online")


def test_the_empty_fleet_says_how_to_start_a_worker(operator_client):
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert 'data-testid="fleet-empty"' in page
    assert (
        "No workers yet: start one with <code>python -m gpuworker daemon --control-url ... --token ...</code>" in page
    )
    assert 'ws-connect="/ws/fleet/"' in page


def test_the_fleet_page_shows_gpus_with_their_live_figures_and_loading_replicas(operator_client):
    worker = make_worker(name="h200-a")
    gpu = GpuFactory(worker=worker, index=0, name="NVIDIA H200")
    replica = ReplicaFactory(
        worker=worker,
        gpu=gpu,
        state=Replica.State.LOADING,
        deployment=DeploymentFactory(model=ModelFactory(public_name="llama-8b")),
    )
    beat(
        worker,
        gpus=[
            {
                "index": 0,
                "utilization_pct": 73.0,
                "memory_used_bytes": 40 * 1024**3,
                "memory_total_bytes": 141 * 1024**3,
                "temperature_c": 61.0,
                "power_w": 412.0,
            }
        ],
        replicas=[{"replica_id": replica.pk, "state": "loading", "load_progress": 0.42}],
    )
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f'id="worker-{worker.pk}"' in page and "h200-a" in page
    assert "GPU 0 · NVIDIA H200" in page
    figures = {
        name: f'id="figure-{worker.pk}-gpu0-{name}" data-testid="figure-{name}">'
        for name in ("utilization", "memory", "temperature", "power")
    }
    assert figures["utilization"] + "73%<" in page
    assert figures["memory"] + "40.0 / 141.0 GiB<" in page
    assert figures["temperature"] + "61 °C<" in page
    assert figures["power"] + "412 W<" in page
    assert f'id="replica-{replica.pk}-progress"' in page and 'aria-valuenow="42"' in page
    assert 'data-testid="drain-worker"' in page and 'data-testid="unload-replica"' in page


def test_the_fleet_page_shows_which_gpus_a_split_replica_holds(operator_client):
    worker = make_worker()
    gpus = [GpuFactory(worker=worker, index=i) for i in range(2)]
    model = ModelFactory(tensor_parallel_size=2)
    replica = ReplicaFactory(
        worker=worker,
        gpu=gpus[0],
        tensor_parallel_size=2,
        state=Replica.State.LOADING,
        deployment=DeploymentFactory(model=model),
    )
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    card = page[page.index(f'id="replica-{replica.pk}"') :]
    assert 'data-testid="replica-gpus">GPUs 0–1<' in card[: card.index("</li>")]
    assert f"{worker.name} · GPUs 0–1 · Loading" in page  # the deployment's list of replicas


def test_the_fleet_page_opens_with_the_last_minute_of_figures_in_its_sparklines(operator_client):
    worker = make_worker()
    GpuFactory(worker=worker, index=0)
    for utilisation in (10.0, 50.0, 90.0):
        beat(worker, gpus=[{"index": 0, "utilization_pct": utilisation}])
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    start = page.index(f'id="figure-{worker.pk}-gpu0-utilization"')
    points = re.search(r'<polyline points="([^"]*)"', page[start:]).group(1).split()
    heights = [float(point.split(",")[1]) for point in points]
    assert len(heights) == 3 and heights[0] > heights[1] > heights[2]  # oldest at the left, 90% highest


def test_the_fleet_page_leaves_out_figures_from_before_a_silence(operator_client):
    worker = make_worker()
    GpuFactory(worker=worker, index=0)
    beat(worker, gpus=[{"index": 0, "utilization_pct": 10.0}], now=timezone.now() - timedelta(minutes=10))
    beat(worker, gpus=[{"index": 0, "utilization_pct": 90.0}])
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    start = page.index(f'id="figure-{worker.pk}-gpu0-utilization"')
    points = re.search(r'<polyline points="([^"]*)"', page[start:]).group(1).split()
    assert len(points) == 2 and points[0].split(",")[1] == points[1].split(",")[1]  # one reading: a flat stub


def test_the_fleet_page_lists_deployments_with_their_forms(operator_client):
    deployment = DeploymentFactory(
        model=ModelFactory(public_name="mistral-7b", context_length=32768),
        desired_replicas=1,
        min_replicas=0,
        max_replicas=3,
        keep_warm=True,
    )
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f'id="deployment-{deployment.pk}"' in page
    assert "context 32768 tokens" in page
    assert "desired 1 · min 0 · max 3 · keep warm" in page
    assert f'name="s{deployment.pk}-desired_replicas"' in page and f'name="d{deployment.pk}-max_replicas"' in page
    assert 'data-testid="load-form"' in page


def test_the_fleet_page_shows_each_ready_replicas_load_and_the_last_autoscaling_decision(operator_client):
    worker = make_worker(name="h200-b")
    gpu = GpuFactory(worker=worker, index=0)
    deployment = DeploymentFactory(
        model=ModelFactory(public_name="qwen-7b"),
        desired_replicas=1,
        max_replicas=3,
        autoscale=True,
        scaled_at=timezone.now() - timedelta(hours=1),
    )
    off = DeploymentFactory(model=ModelFactory(public_name="manual-7b"), autoscale=False)
    replica = ReplicaFactory(
        worker=worker, gpu=gpu, deployment=deployment, state=Replica.State.READY, endpoint_url="http://127.0.0.1:9100"
    )
    acme, gone = TenantFactory(name="acme"), TenantFactory(name="gone")
    gone_id = gone.pk
    gone.delete()
    beat(
        worker,
        gpus=[{"index": 0, "utilization_pct": 50.0}],
        replicas=[
            {
                "replica_id": replica.pk,
                "state": "ready",
                "endpoint_url": "http://127.0.0.1:9100",
                "running": 5,
                "waiting": 3,
                "kv_cache_usage": 0.62,
                "tokens_per_s": 1234.5,
                "prefix_cache_hit_rate": 0.5,
                "host_cache_hit_rate": 0.125,
                "tenant_shares": {str(gone_id): 0.25, str(acme.pk): 0.7, "": 0.05},
            }
        ],
    )
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f'id="replica-{replica.pk}-load"' in page
    # 1234.5 rounds half to even; the host tier's share of prompt tokens is part of the cache hits.
    assert "queue 3 · running 5 · KV 62% · 1,234 tok/s · cache hits 50% (host tier 12%)" in page
    # Each tenant's share of the replica lately, busiest first, by name (a deleted one by id).
    assert f"shares: acme 70%, tenant {gone_id} 25%, no tenant 5%" in page
    acme.name = "acme & co"
    acme.save()
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    assert f"shares: acme &amp; co 70%, tenant {gone_id} 25%" in page
    assert f'id="deployment-{deployment.pk}-autoscale"' in page and "Autoscaling on; no decision yet." in page
    assert f'id="deployment-{off.pk}-autoscale"' in page and "Autoscaling off" in page

    deployments_autoscale(now=timezone.now())  # no traffic counted: the busy replica still drives it
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    block = page[page.index(f'id="deployment-{deployment.pk}-autoscale"') :]
    # 8 in flight on one replica that should carry 8 × 70%: two replicas.
    assert 'data-action="up"' in block and "Scaled up · 2" in block
    assert "utilisation 100% of 1 ready (target 70%), above 84%" in block
    assert "waiting 3 · running 5" in block


# Another process of the embedded set-up (no Redis: the live cache on files under VAR_DIR) renames
# a tenant, as the admin, a shell or a task would.
_RENAME_ELSEWHERE = """
import sys, django
django.setup()
from controlplane.accounts.models import Tenant
tenant = Tenant.objects.get(pk=int(sys.argv[1]))
tenant.name = sys.argv[2]
tenant.save()
"""


@pytest.mark.django_db(transaction=True)
def test_without_redis_the_fleet_page_shows_a_rename_made_in_another_process(
    client, settings, tmp_path, require_postgres
):
    from django.db import connection

    var = tmp_path / "var"
    settings.REDIS_URL = ""
    settings.CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": f"web-{tmp_path.name}"},
        "live": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(var / "cache" / "live"),
        },
    }
    client.force_login(make_user(User.Role.OPERATOR))
    worker = make_worker(name="h100-a")
    replica = ReplicaFactory(worker=worker, state=Replica.State.READY, endpoint_url="http://127.0.0.1:9100")
    acme = TenantFactory(name="acme")
    load = {"replica_id": replica.pk, "state": "ready", "endpoint_url": replica.endpoint_url}
    beat(worker, replicas=[{**load, "tenant_shares": {str(acme.pk): 1.0}}])
    assert "shares: acme 100%" in client.get(reverse("dashboard:fleet")).content.decode()
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
    database_url = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {**os.environ, "REDIS_URL": "", "VAR_DIR": str(var), "DATABASE_URL": database_url}
    subprocess.run(
        [sys.executable, "-c", _RENAME_ELSEWHERE, str(acme.pk), "acme & co"], env=env, check=True, timeout=120
    )
    assert "shares: acme &amp; co 100%" in client.get(reverse("dashboard:fleet")).content.decode()


def test_the_fleet_pages_live_parts_are_rendered_in_one_place():
    # Only fragments.py renders them (the page includes the same templates); no answer to a form
    # or button includes one, so no part of the page is drawn both by an answer and by the push.
    renderers = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "controlplane").rglob("*.py")
        if any(f"dashboard/ops/{name}" in path.read_text() for name in LIVE_TEMPLATES)
    )
    assert renderers == ["controlplane/dashboard/ops/fragments.py"]
    for answer in ANSWER_TEMPLATES:
        text = (OPS_TEMPLATES / answer).read_text()
        assert not [name for name in LIVE_TEMPLATES if name in text], answer


def test_a_fleet_page_whose_websocket_is_down_catches_up_over_http(operator_client):
    worker = make_worker()
    deployment = DeploymentFactory(desired_replicas=1, min_replicas=0, max_replicas=4)
    page = operator_client.get(reverse("dashboard:fleet")).content.decode()
    catch_up = page[page.index('id="fleet-catch-up"') :]
    assert f'hx-get="{reverse("dashboard:fleet_live")}" hx-swap="none"' in catch_up[:200]
    assert 'hx-trigger="fleet-changed[!fleetLive()] from:body, every 10s [!fleetLive()]"' in catch_up
    # What a reconnecting WebSocket gets, each part marked to be swapped in by id.
    live = operator_client.get(reverse("dashboard:fleet_live")).content.decode()
    assert live.lstrip().startswith('<div id="workers" class="workers" data-testid="workers" hx-swap-oob="true">')
    assert f'id="worker-{worker.pk}"' in live
    status = live[live.index(f'id="deployment-{deployment.pk}-status"') :]
    assert 'data-desired="1" hx-swap-oob="true"' in status[:300] and "desired 1 · min 0 · max 4" in status
    assert 'data-testid="scale-form"' not in live and 'data-testid="limits-form"' not in live  # forms left alone
