"""The operators' fleet page, live: a device's figures update from the heartbeats without a reload,
and scaling a deployment shows its new replica appear, load and become ready, while the forms put
bad values' messages beside their fields and the audit log records who did it.

The browser-test daemon runs on CPU, so its worker card has no GPU slot: its CPU slot's live
figures (utilisation, memory, each with a sparkline) are checked, and temperature and power show as
unavailable. A GPU host is then registered through the internal API, reporting NVML-style figures
in its heartbeats as a daemon on a GPU machine does, and its GPU's figures are followed live.
"""

import re

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

pytestmark = pytest.mark.slow

MARK_DOCUMENT = "window.__fleetDocument = 'still the same page'"
SAME_DOCUMENT = "window.__fleetDocument === 'still the same page'"


def _open_fleet(open_page):
    page = open_page("operator")
    page.goto(reverse("dashboard:fleet"))
    expect(page.locator("#live-status")).to_have_attribute("data-connected", "true")
    page.evaluate(MARK_DOCUMENT)  # a reload would lose it
    return page


def _points(page, selector: str) -> int:
    return page.locator(selector).evaluate(
        "svg => svg.querySelector('polyline').getAttribute('points').split(' ').filter(Boolean).length"
    )


def test_a_devices_live_figures_change_without_reloading(open_page):
    page = _open_fleet(open_page)
    worker = page.locator("[data-testid=worker-card][data-state=online]").first
    expect(worker).to_be_visible()
    cpu = worker.locator("[data-testid=slot][data-slot=cpu]")
    utilisation = cpu.locator("[data-figure=utilization]")
    memory = cpu.locator("[data-figure=memory]")
    expect(utilisation.locator(".value")).to_have_text(re.compile(r"^\d+%$"))
    expect(memory.locator(".value")).to_have_text(re.compile(r"^\d+\.\d / \d+\.\d GiB$"))
    for unreported in ("temperature", "power"):
        expect(cpu.locator(f"[data-figure={unreported}]")).to_have_class(re.compile(r"\bunavailable\b"))
        expect(cpu.locator(f"[data-figure={unreported}] .value")).to_have_text("—")

    # Record what the utilisation figure shows each time the live fragments touch the page.
    figure = f"#{cpu.locator('.metrics').get_attribute('id')} [data-figure=utilization]"
    page.evaluate(
        """figure => {
        window.__seen = [];
        new MutationObserver(() => window.__seen.push([
            document.querySelector(`${figure} .value`)?.textContent,
            document.querySelector(`${figure} polyline`)?.getAttribute("points")]))
          .observe(document.getElementById("fleet-live"),
                   {subtree: true, childList: true, characterData: true, attributes: true});
    }""",
        figure,
    )
    # The page opens with the last minute of heartbeats already drawn (the system has been up for
    # longer than a few heartbeats by now), not an empty line.
    assert _points(page, f"{figure} svg") >= 3
    # Each heartbeat (about one a second) redraws the sparkline: wait for three of them.
    page.wait_for_function(
        "new Set(window.__seen.map(([, points]) => points).filter(Boolean)).size >= 3", timeout=30_000
    )
    seen = page.evaluate("window.__seen")
    assert len({points for _, points in seen}) >= 3, f"the sparkline was redrawn fewer than three times: {seen}"
    assert all(re.fullmatch(r"\d+%", text) for text, _ in seen if text is not None), seen
    assert page.evaluate(SAME_DOCUMENT), "the page was reloaded"


def test_a_gpus_live_figures_change_without_reloading(open_page, system):
    """A GPU host reports through the internal API exactly as a daemon on a GPU machine does
    (registration, then NVML figures in each heartbeat); its GPU's figures on the open page follow
    each heartbeat. It reports itself draining, so nothing is placed on a host with no daemon."""
    headers = {"Authorization": f"Bearer {system.fleet.token}"}
    total = 141 * 2**30
    registered = httpx.post(
        f"{system.url}/internal/workers/register",
        headers=headers,
        timeout=10,
        json={
            "name": "gpu-host-browser",
            "advertise_host": "10.0.0.7",
            "device": "cuda",
            "version": "test",
            "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_total_bytes": total}],
            "cpu": {"memory_total_bytes": 2**38, "cores": 16},
        },
    )
    registered.raise_for_status()
    worker_id = registered.json()["worker_id"]

    def beat(utilisation: float, temperature: float, power: float) -> None:
        httpx.post(
            f"{system.url}/internal/workers/{worker_id}/heartbeat",
            headers=headers,
            timeout=10,
            json={
                "draining": True,
                "replicas": [],
                "gpus": [
                    {
                        "index": 0,
                        "utilization_pct": utilisation,
                        "memory_used_bytes": 40 * 2**30,
                        "memory_total_bytes": total,
                        "temperature_c": temperature,
                        "power_w": power,
                    }
                ],
                "cpu": {"utilization_pct": 3.0, "memory_used_bytes": 2**33, "memory_total_bytes": 2**38},
            },
        ).raise_for_status()

    beat(17, 41, 212)
    page = _open_fleet(open_page)
    figure = f"#figure-{worker_id}-gpu0-"
    expect(page.locator(figure + "utilization")).to_have_text("17%")
    sparkline = f"#metrics-{worker_id}-gpu0 [data-figure=utilization] svg"
    for utilisation, temperature, power in ((64, 48, 455), (83, 55, 612), (71, 52, 530)):
        beat(utilisation, temperature, power)
        expect(page.locator(figure + "utilization")).to_have_text(f"{utilisation}%")
        expect(page.locator(figure + "temperature")).to_contain_text(str(temperature))
        expect(page.locator(figure + "power")).to_contain_text(str(power))
    assert _points(page, sparkline) >= 3  # a point per heartbeat seen since the page opened
    assert page.evaluate(SAME_DOCUMENT), "the page was reloaded"


def _deployment(page, model: str):
    return page.locator(f"[data-testid=deployment][data-model='{model}']")


def _scale(deployment, replicas: int | str) -> None:
    deployment.locator("[data-testid=scale-form] input[name$=desired_replicas]").fill(str(replicas))
    deployment.locator("[data-testid=scale-submit]").click()


def _set_limits(deployment, **values) -> None:
    form = deployment.locator("[data-testid=limits-form]")
    if not form.is_visible():
        deployment.locator("summary").click()
    for name, value in values.items():
        form.locator(f"input[name$=-{name}]").fill(str(value))
    form.locator("[data-testid=limits-submit]").click()


def test_scale_a_deployment_and_watch_the_new_replica_become_ready(open_page, system):
    model = system.seeded.demo_model
    page = _open_fleet(open_page)
    # While the WebSocket is up it is the only way the live parts arrive: no catch-up over HTTP.
    catch_ups, live_path = [], reverse("dashboard:fleet_live")
    page.on("request", lambda request: catch_ups.append(request.url) if live_path in request.url else None)
    replicas = page.locator(f"[data-testid=worker-card] [data-testid=replica][data-model='{model}']")
    expect(replicas).to_have_count(1, timeout=120_000)
    expect(replicas.first).to_have_attribute("data-state", "ready", timeout=120_000)
    first_id = replicas.first.get_attribute("id")
    deployment = _deployment(page, model)

    # Bad values: each message beside its field, and nothing changes. Past Max (the demo allows
    # two), the message says which limit to change and the limits form opens, filled in to allow it.
    _scale(deployment, 3)
    error = _deployment(page, model).locator("[data-testid=scale-form] [data-testid=field-error]")
    expect(error).to_contain_text("This deployment allows 0 to 2 replicas; raise Max replicas to scale to 3.")
    limits = _deployment(page, model).locator("[data-testid=limits-form]")
    expect(limits).to_be_visible()
    expect(limits.locator("input[name$=-max_replicas]")).to_have_value("3")
    # A negative count: the form is sent (novalidate) and refused by the server beside the field.
    _scale(_deployment(page, model), -1)
    expect(_deployment(page, model).locator("[data-testid=scale-form] [data-testid=field-error]")).to_contain_text(
        "greater than or equal to 0"
    )
    _set_limits(_deployment(page, model), min_replicas=3, max_replicas=2)
    limits = _deployment(page, model).locator("[data-testid=limits-form]")
    expect(limits.locator("[id$=-min_replicas].field [data-testid=field-error]")).to_contain_text(
        "cannot exceed max replicas (2)"
    )
    expect(limits.locator("[id$=-max_replicas].field [data-testid=field-error]")).to_have_count(0)
    expect(_deployment(page, model).locator("[data-testid=deployment-status]")).to_have_attribute("data-desired", "1")

    # Room for three, then ask for two: the new replica appears on the worker card and loads. The
    # status shows each change from the live push alone, and each form's answer replaces only that
    # form, so the scale form is used at once, whether or not the limits' answer has landed yet.
    _set_limits(_deployment(page, model), min_replicas=0, max_replicas=3, desired_replicas=1)
    expect(_deployment(page, model).locator("[data-testid=deployment-status]")).to_contain_text("max 3")
    _scale(_deployment(page, model), 2)
    expect(_deployment(page, model).locator("[data-testid=deployment-status]")).to_have_attribute("data-desired", "2")
    expect(_deployment(page, model).locator("[data-testid=scale-done]")).to_contain_text("now wants 2 replicas.")
    expect(_deployment(page, model).locator("[data-testid=limits-form]")).to_be_hidden()  # closed on its answer
    expect(_deployment(page, model).locator("[data-testid=limits-done]")).to_contain_text("updated.")
    expect(replicas).to_have_count(2, timeout=60_000)
    new = page.locator(f"[data-testid=replica][data-model='{model}']:not(#{first_id})")
    expect(new).to_have_attribute("data-state", re.compile(r"pending|loading|ready"))
    expect(new).to_have_attribute("data-state", "ready", timeout=180_000)
    expect(page.locator(f"#{first_id}")).to_have_attribute("data-state", "ready")
    expect(_deployment(page, model).locator("[data-testid=deployment-replica][data-state=ready]")).to_have_count(
        2, timeout=30_000
    )
    assert page.evaluate(SAME_DOCUMENT), "the page was reloaded"

    # Back to one: the newest replica is drained and leaves the card.
    _scale(_deployment(page, model), 1)
    expect(replicas).to_have_count(1, timeout=90_000)
    expect(page.locator(f"#{first_id}")).to_have_attribute("data-state", "ready")
    assert catch_ups == []

    # Every action is in the audit log, with who did it.
    page.goto(reverse("dashboard:audit"))

    def rows(action: str):
        return (
            page.locator(f"[data-testid=audit-row][data-action='{action}']")
            .filter(has_text=model)
            .filter(has_text="operator")
        )

    expect(rows("deployment.scale")).to_have_count(2)
    expect(rows("deployment.scale").first).to_contain_text("desired_replicas: 2 → 1")
    expect(rows("deployment.update")).to_have_count(1)
    expect(rows("deployment.update")).to_contain_text("max_replicas: 2 → 3")


def test_a_page_whose_websocket_is_down_still_shows_each_change(open_page, system):
    """Behind a proxy that drops WebSockets, say: the page says it is not live, and its live parts
    come over HTTP instead, at once after the operator's own change (then every 10 s)."""
    model = system.seeded.demo_model
    page = open_page("operator")
    page.route_web_socket("**/ws/fleet/", lambda socket: socket.close())  # never reaches the server
    page.goto(reverse("dashboard:fleet"))
    expect(page.locator("#live-status")).to_have_text("Reconnecting…")
    page.evaluate(MARK_DOCUMENT)
    status = _deployment(page, model).locator("[data-testid=deployment-status]")
    before = re.search(r"max (\d+)", status.inner_text()).group(1)
    for max_replicas in (int(before) + 1, int(before)):  # and back, as the next tests expect it
        _set_limits(_deployment(page, model), max_replicas=max_replicas)
        expect(_deployment(page, model).locator("[data-testid=limits-done]")).to_contain_text("updated.")
        # Sooner than the 10 s poll: the answer's fleet-changed fetched it.
        expect(status).to_contain_text(f"max {max_replicas}", timeout=9_000)
    expect(page.locator("#live-status")).to_have_attribute("data-connected", "false")
    assert page.evaluate(SAME_DOCUMENT), "the page was reloaded"
