"""The playground: an answer streams in over the WebSocket (the text grows while the status still
says streaming), is billed like an API request, and Stop aborts the generation on the worker.

The demo model has random weights; at temperature 0 its answer to PROMPT runs to max_tokens
without an end-of-text token, which gives a stream long enough to watch and to stop."""

import re
import time

import httpx
import pytest
from django.urls import reverse
from playwright.sync_api import expect

from tests.integration.conftest import wait_until

pytestmark = pytest.mark.slow

PROMPT = "hello"
MAX_TOKENS = 1900  # the demo model has a 2048-token context; the prompt takes about 60
_SAMPLE = """() => [document.getElementById("playground-output").textContent.length,
                    document.getElementById("playground-status").dataset.state]"""


@pytest.fixture
def demo_replicas(system, orm):
    """The demo model's ready replicas' endpoints, once there is at least one."""
    from controlplane.fleet.models import Replica

    def ready():
        return list(
            Replica.objects.filter(
                deployment__model__public_name=system.seeded.demo_model, state=Replica.State.READY
            ).values_list("endpoint_url", flat=True)
        )

    return wait_until(lambda: orm(ready), timeout=180, what="a ready replica of the demo model", fleet=system.fleet)


def _send(page, *, max_tokens: int = MAX_TOKENS) -> None:
    page.goto(reverse("dashboard:playground"))
    page.select_option("#id_model", "demo-tiny")
    page.fill("#id_system_prompt", "You are a test.")
    page.fill("#id_temperature", "0")
    page.fill("#id_max_tokens", str(max_tokens))
    page.fill("#id_message", PROMPT)
    page.click("#playground-send")


def _replica_metrics(system, endpoints: list[str]) -> dict[str, float]:
    """Each metric summed over the demo replicas, from their own /metrics."""
    totals: dict[str, float] = {}
    for endpoint in endpoints:
        response = httpx.get(
            f"{endpoint}/metrics", headers={"Authorization": f"Bearer {system.fleet.token}"}, timeout=10
        )
        response.raise_for_status()
        for line in response.text.splitlines():
            if line.startswith("vllm:"):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _latest_usage(orm, system):
    from controlplane.billing.models import UsageRecord

    return orm(
        lambda: (
            UsageRecord.objects.filter(tenant__name=system.seeded.tenant_name)
            .order_by("-created_at", "-pk")
            .values("status", "completion_tokens", "price_charged")
            .first()
        )
    )


def test_answer_streams_in_before_it_finishes(open_page, system, demo_replicas, orm):
    page = open_page("tenant")
    _send(page)

    # Two samples of the text while the status still says streaming, the second longer.
    page.wait_for_function(f"() => {{ const [n, s] = ({_SAMPLE})(); return n > 0 && s === 'streaming'; }}")
    first, state = page.evaluate(_SAMPLE)
    assert state == "streaming"
    page.wait_for_function(f"() => {{ const [n, s] = ({_SAMPLE})(); return n > {first} || s !== 'streaming'; }}")
    second, state = page.evaluate(_SAMPLE)
    assert state == "streaming" and second > first, (
        f"the text did not grow while streaming: {first} then {second} characters, status {state}"
    )
    expect(page.locator("#playground-stop")).to_be_enabled()
    expect(page.locator("#playground-send")).to_be_disabled()

    status = page.locator("#playground-status")
    expect(status).to_have_attribute("data-state", "done", timeout=120_000)
    expect(status).to_contain_text(f"{MAX_TOKENS} completion tokens")
    assert len(page.inner_text("#playground-output")) >= second
    expect(page.locator("#playground-send")).to_be_enabled()
    expect(page.locator("#playground-stop")).to_be_disabled()
    # Billed like an API request: a completed usage record for the tenant, with every token.
    usage = wait_until(
        lambda: (u := _latest_usage(orm, system)) and u["status"] == "completed" and u,
        timeout=15,
        what="the answer's usage record",
        fleet=system.fleet,
    )
    assert usage["completion_tokens"] == MAX_TOKENS


def test_stop_aborts_the_generation_on_the_worker(open_page, system, demo_replicas, orm):
    generated_before = _replica_metrics(system, demo_replicas)["vllm:generation_tokens_total"]
    page = open_page("tenant")
    _send(page)
    page.wait_for_function(f"() => {{ const [n, s] = ({_SAMPLE})(); return n > 0 && s === 'streaming'; }}")
    page.click("#playground-stop")

    status = page.locator("#playground-status")
    expect(status).to_have_attribute("data-state", "stopped")
    expect(status).to_contain_text("Stopped")
    stopped_at = len(page.inner_text("#playground-output"))
    expect(page.locator("#playground-send")).to_be_enabled()
    expect(page.locator("#playground-stop")).to_be_disabled()
    # On the worker: the request leaves the running batch without finishing. A request that ran
    # to the end would add its MAX_TOKENS to the finished requests' token counter; one aborted
    # adds none of them.
    metrics = wait_until(
        lambda: (m := _replica_metrics(system, demo_replicas))["vllm:num_requests_running"] == 0 and m,
        timeout=30,
        what="the replicas to have no request running",
        fleet=system.fleet,
    )
    assert metrics["vllm:generation_tokens_total"] - generated_before < MAX_TOKENS, "the generation ran to its end"
    time.sleep(1.0)
    assert len(page.inner_text("#playground-output")) == stopped_at, "text kept arriving after Stop"

    usage = wait_until(
        lambda: (u := _latest_usage(orm, system)) and u["status"] == "cancelled" and u,
        timeout=15,
        what="the stopped request's usage record",
        fleet=system.fleet,
    )
    assert 0 < usage["completion_tokens"] < MAX_TOKENS

    # The page is usable again: the next answer streams to the end. (The stopped answer, as far
    # as it went, joined the conversation and emptied the message box.)
    expect(page.locator("[data-testid=playground-turn]")).to_have_count(1)
    page.fill("#id_message", "go on")
    page.fill("#id_max_tokens", "16")
    page.click("#playground-send")
    expect(status).to_have_attribute("data-state", "done", timeout=60_000)
    expect(status).to_contain_text(re.compile(r"16 completion tokens"))


def test_playground_form_shows_each_error_beside_its_field(open_page, system):
    page = open_page("tenant")
    page.goto(reverse("dashboard:playground"))
    page.fill("#id_temperature", "3")
    page.fill("#id_max_tokens", "5000")
    page.fill("#id_message", "   ")
    page.click("#playground-send")

    expect(page.locator("#playground-status")).to_have_attribute("data-state", "invalid")
    expect(page.locator("#field-temperature #error-temperature")).to_contain_text("less than or equal to 2")
    expect(page.locator("#field-max_tokens #error-max_tokens")).to_contain_text("4096")
    expect(page.locator("#field-message #error-message")).to_contain_text("Write a message")
    expect(page.locator("#field-model #error-model")).to_be_hidden()
    expect(page.locator("#playground-output")).to_have_text("")

    # Beyond the model's context: the limit named for the chosen model (the page preselects whichever
    # chat model is ready first, so this one is chosen by name).
    page.select_option("#id_model", "demo-tiny")
    page.fill("#id_temperature", "0.5")
    page.fill("#id_max_tokens", "2048")
    page.fill("#id_message", "hi")
    page.click("#playground-send")
    expect(page.locator("#field-max_tokens #error-max_tokens")).to_contain_text("At most 2047 for demo-tiny")
    expect(page.locator("#field-temperature #error-temperature")).to_be_hidden()


def test_a_conversation_goes_on_and_view_code_follows_the_settings(open_page, system, demo_replicas):
    page = open_page("tenant")
    _send(page, max_tokens=8)
    status = page.locator("#playground-status")
    expect(status).to_have_attribute("data-state", "done", timeout=60_000)
    first_answer = page.inner_text("#playground-output")
    expect(page.locator("#id_message")).to_have_value("")  # emptied for the next message

    page.fill("#id_message", "and then?")
    page.click("#playground-send")
    expect(status).to_have_attribute("data-state", "done", timeout=60_000)
    turns = page.locator("[data-testid=playground-turn]")
    expect(turns).to_have_count(3)  # the first question, its answer, the second question
    expect(turns.nth(0)).to_contain_text(PROMPT)
    assert first_answer.strip() in turns.nth(1).inner_text()
    expect(turns.nth(2)).to_contain_text("and then?")

    page.fill("#id_top_p", "0.8")
    page.click("#playground-code summary")
    python = page.locator("#code-python")
    expect(python).to_contain_text('model="demo-tiny"')
    expect(python).to_contain_text("top_p=0.8")
    expect(python).to_contain_text("and then?")  # the conversation so far, up to the last answer
    expect(page.locator("#code-shell")).to_contain_text("curl ")
    expect(page.locator("#code-javascript")).to_contain_text("fetch(")
    assert "sk-" not in page.inner_text("#playground-code")

    page.click("#playground-clear")
    expect(status).to_have_attribute("data-state", "idle")
    expect(turns).to_have_count(0)
    expect(page.locator("#playground-history")).to_have_value("")


def test_stop_sits_beside_send(open_page, system):
    page = open_page("tenant")
    page.goto(reverse("dashboard:playground"))
    send, stop = page.locator("#playground-send").bounding_box(), page.locator("#playground-stop").bounding_box()
    assert abs(send["y"] - stop["y"]) < 1 and abs(send["height"] - stop["height"]) < 1, (send, stop)
    assert 0 < stop["x"] - (send["x"] + send["width"]) < 40, (send, stop)  # just right of Send


def test_an_operator_tries_a_model_billed_to_the_staff_tenant(open_page, demo_replicas, orm):
    from django.conf import settings

    from controlplane.billing.models import UsageRecord

    def staff_requests() -> int:
        return UsageRecord.objects.filter(tenant__name=settings.PLAYGROUND_STAFF_TENANT).count()

    before = orm(staff_requests)
    page = open_page("operator")
    _send(page, max_tokens=8)
    expect(page.locator("#playground-billed-to")).to_contain_text(settings.PLAYGROUND_STAFF_TENANT)
    expect(page.locator("#playground-status")).to_have_attribute("data-state", "done")
    assert page.locator("#playground-output").text_content()
    wait_until(lambda: orm(staff_requests) == before + 1, timeout=30, what="the operator's request, billed")
