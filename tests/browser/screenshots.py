"""Screenshots of the dashboard's main pages for docs/screenshots/ and the README, taken from the
real system the browser tests start (tests/browser/system.py), in Debian's headless Chromium at
1280x800 (docs/screenshots/<page>.png) and again at a phone's 390 px (docs/screenshots/phone/<page>.png,
the whole page); a page wider than the phone's window stops the script:

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpuserve REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python -m tests.browser.screenshots [--out docs/screenshots]

It works in a throwaway database (`<name>_screenshots`, created and dropped here) and needs a Redis
database no running system uses (its Celery worker takes tasks from that Redis's default queue).
Today's figures come from real requests through /v1 and real operator actions; so that the daily
charts have days to show, the two weeks before today are back-filled with usage records written
through the gateway's own billing path (a credit hold, then its settlement), marked `screenshots-`
in their ids.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import uuid
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

PAGES = {  # file name: (role, url name)
    "home-operator": ("operator", "dashboard:home"),
    "home-tenant": ("tenant", "dashboard:home"),
    "home-admin": ("admin", "dashboard:home"),
    "fleet": ("operator", "dashboard:fleet"),
    "catalog": ("operator", "dashboard:catalog"),
    "catalog-form": ("operator", ""),  # the spare model's edit form, from prepare()
    "audit": ("operator", "dashboard:audit"),
    "keys": ("tenant", "dashboard:keys"),
    "quickstart": ("tenant", "dashboard:quickstart"),
    "usage": ("tenant", "dashboard:usage"),
    "usage-by-model-and-key": ("tenant", "dashboard:usage"),
    "requests": ("tenant", "dashboard:requests"),
    "requests-refused": ("tenant", "dashboard:requests"),
    "playground": ("tenant", "dashboard:playground"),
    "reports": ("admin", "dashboard:reports"),
    "credits": ("tenant", "dashboard:credits"),
    "team": ("tenant", "dashboard:team"),
    "tenants": ("admin", "dashboard:tenants"),
    "tenant": ("admin", "dashboard:tenants"),  # then into the demo tenant's page
    "staff": ("admin", "dashboard:staff"),
    "invitation": (None, ""),  # the link prepare() made, opened by someone not signed in
    "not-found": ("tenant", ""),  # a missing page: the dashboard's 404
}
LINKS = {"not-found": "/no-such-page/"}
# Below the fold: the section itself, whole.
SECTIONS = {"usage-by-model-and-key": "#usage-breakdown", "requests-refused": "#requests-refused"}
# Charts are sized when drawn: at the phone's width the page is loaded again.
CHARTS = ("usage", "usage-by-model-and-key", "reports")
HISTORY_DAYS = 14


def _chat(system, api_key: str, *, max_tokens: int = 24, model: str | None = None, path: str = "chat/completions"):
    import httpx

    return httpx.post(
        f"{system.url}/v1/{path}",
        timeout=60,
        headers={"Authorization": f"Bearer {api_key}"},
        json={
            "model": model or system.seeded.demo_model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Summarise the fleet's week."}],
        },
    ).raise_for_status()


def _refuse(system, api_key: str) -> None:
    """Requests the gateway refuses (a model not in the catalog, a body /v1/embeddings cannot read),
    once their per-minute tallies are written."""
    import httpx

    from controlplane.billing.models import Refusal
    from tests.integration.conftest import wait_until

    for model, path in (("llama-3-70b", "chat/completions"), ("demo-tiny", "embeddings")):
        with contextlib.suppress(httpx.HTTPStatusError):
            _chat(system, api_key, model=model, path=path)
    wait_until(
        lambda: Refusal.objects.filter(api_key__isnull=False).count() >= 2,
        timeout=60,
        what="the refusals' tallies",
        fleet=system.fleet,
    )


def prepare(system) -> dict[str, str]:
    """Give every page something to show: keys, traffic, operator actions, two weeks of history,
    credit grants, a team; returns the paths of pages only a secret link opens."""
    from django.urls import reverse
    from django.utils import timezone

    from controlplane.accounts.models import User
    from controlplane.accounts.selectors import tenant_get_by_name, user_get_by_username
    from controlplane.accounts.services import api_key_create, api_key_revoke, invitation_create, user_create
    from controlplane.billing.models import UsageRecord
    from controlplane.billing.services import credit_grant
    from controlplane.catalog.models import Deployment, Model
    from controlplane.catalog.services import model_create, model_set_enabled
    from controlplane.fleet.models import Replica
    from controlplane.fleet.services.deployments import deployment_update
    from tests.browser.system import PASSWORD
    from tests.controlplane.factories import usage_record_settled
    from tests.integration.conftest import wait_until

    demo = Model.objects.get(public_name=system.seeded.demo_model)
    wait_until(
        lambda: Replica.objects.filter(deployment__model=demo, state=Replica.State.READY).exists(),
        timeout=180,
        what="a ready replica of the demo model",
        fleet=system.fleet,
    )
    tenant = tenant_get_by_name(name=system.seeded.tenant_name)
    other = tenant_get_by_name(name=system.seeded.other_tenant_name)
    alice = user_get_by_username(username=system.login("tenant").username)
    operator = user_get_by_username(username=system.login("operator").username)

    production = api_key_create(tenant=tenant, name="production", created_by=alice)
    staging = api_key_create(
        tenant=tenant, name="staging", rate_limit_per_minute=30, monthly_spend_limit=Decimal("5.00"), created_by=alice
    )
    api_key_revoke(api_key=api_key_create(tenant=tenant, name="laptop (old)", created_by=alice).api_key)
    other_created = api_key_create(tenant=other, name="batch jobs")
    other_key = other_created.plaintext
    for _ in range(8):
        _chat(system, production.plaintext)
    for _ in range(4):
        _chat(system, other_key)
    _refuse(system, staging.plaintext)

    deployment = Deployment.objects.get(model=demo)
    deployment_update(
        deployment=deployment,
        desired_replicas=deployment.desired_replicas,
        min_replicas=1,
        max_replicas=2,
        keep_warm=True,
        actor=operator,
    )
    spare = model_create(
        public_name="demo-tiny-eval",
        family="llama",
        kind=Model.Kind.CHAT,
        weights_path=demo.weights_path,
        context_length=demo.context_length,
        max_model_len=demo.context_length * 2,
        allow_long_context=True,
        parameter_count=demo.parameter_count,
        price_tier=demo.price_tier,
        actor=operator,
    )
    model_set_enabled(model=spare, enabled=False, actor=operator)

    admin = user_get_by_username(username=system.login("admin").username)
    credit_grant(tenant=tenant, amount=Decimal("25.00"), memo="Pilot top-up", created_by=admin)
    credit_grant(tenant=other, amount=Decimal("5.00"), memo="Goodwill: outage on the 3rd", created_by=admin)
    user_create(
        username="bilal", password=PASSWORD, role=User.Role.TENANT_MEMBER, tenant=tenant, email="bilal@example.com"
    )
    invitation_create(created_by=alice, role=User.Role.TENANT_MEMBER, tenant=tenant, note="Chen (data team)")
    staff_invitation = invitation_create(created_by=admin, role=User.Role.OPERATOR, note="On-call SRE")
    links = {
        **LINKS,
        "invitation": reverse("dashboard:invitation_accept", args=[staff_invitation.token]),
        "catalog-form": reverse("dashboard:catalog_edit", args=[spare.pk]),
    }

    rng = random.Random(7)
    now = timezone.now()
    for days_ago in range(1, HISTORY_DAYS):
        for who, keys, base in (
            (tenant, (production.api_key, staging.api_key), 40),
            (other, (other_created.api_key,), 15),
        ):
            for _ in range(max(0, int(base * (0.6 + 0.8 * rng.random())))):
                prompt, completion = rng.randint(20, 400), rng.randint(10, 300)
                usage_record_settled(
                    request_id=f"screenshots-{uuid.uuid4().hex}",
                    tenant=who,
                    model=demo,
                    api_key=rng.choice(keys),
                    status=UsageRecord.Status.COMPLETED if rng.random() > 0.03 else UsageRecord.Status.FAILED,
                    prompt_tokens=prompt,
                    completion_tokens=completion,
                    time_to_first_token_ms=rng.randint(20, 90),
                    total_latency_ms=rng.randint(200, 2500),
                    gpu_time_s=completion * 0.004,
                    error_code="replica_unavailable",  # kept only on the failed ones
                    at=now - timedelta(days=days_ago, minutes=rng.randint(0, 600)),
                )
    return links


def shoot(system, out: Path, links: dict[str, str]) -> list[Path]:
    from django.urls import reverse
    from playwright.sync_api import expect, sync_playwright

    from tests.browser.system import VIEWPORT, launch_options, log_in

    (out / "phone").mkdir(parents=True, exist_ok=True)
    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(**launch_options())
        pages = {}
        for role in {role for role, _ in PAGES.values()}:  # None: not signed in
            context = browser.new_context(base_url=system.url, viewport=VIEWPORT)
            context.set_default_timeout(60_000)
            pages[role] = context.new_page()
            if role is not None:
                log_in(pages[role], system.login(role))
        for name, (role, url_name) in PAGES.items():
            page = pages[role]
            page.goto(links[name] if name in links else reverse(url_name))
            if name == "fleet":
                expect(page.locator("#live-status")).to_have_attribute("data-connected", "true")
                page.wait_for_timeout(20_000)  # twenty heartbeats, so the sparklines have a history
            elif name == "playground":
                page.fill("#id_system_prompt", "You are a concise assistant.")
                page.fill("#id_max_tokens", "40")
                for sent, message in enumerate(("Write a haiku about GPUs.", "Now one about CPUs."), start=1):
                    page.fill("#id_message", message)
                    page.click("#playground-send")
                    # Started (the previous answer's "done" is still showing until then), then done.
                    expect(page.locator(".turn-user")).to_have_count(sent)
                    # The page offers the real chat model: its answer takes a while on a busy CPU.
                    expect(page.locator("#playground-status")).to_have_attribute("data-state", "done", timeout=240_000)
                page.click("#playground-code summary")
                expect(page.locator("#code-python")).to_be_visible()
            elif name == "team":
                page.fill("#id_note", "Dana (new hire)")
                page.click("#invite-submit")
                expect(page.locator("#invite-link")).to_be_visible()
            elif name == "tenant":
                page.locator(f'[data-testid=tenant-row][data-tenant-name="{system.seeded.tenant_name}"] a').click()
                page.fill("#id_amount", "10")
                page.fill("#id_reason", "Conference demo credit")
                page.click("#grant-submit")
                expect(page.locator("#grant-done")).to_be_visible()
            elif name == "requests-refused":
                expect(page.locator("[data-testid=refused-row]")).not_to_have_count(0)
            elif name in ("usage", "reports"):
                page.wait_for_selector(".uplot")
            elif name == "usage-by-model-and-key":
                page.wait_for_selector("#usage-chart-by-key .uplot")
            page.wait_for_timeout(500)  # fonts, charts' first paint
            path = out / f"{name}.png"
            if name in SECTIONS:
                page.locator(SECTIONS[name]).screenshot(path=path)
            else:
                page.screenshot(path=path, full_page=name.startswith("home") or name in ("playground", "reports"))
            written += [path, _shoot_phone(page, name, out / "phone" / f"{name}.png")]
            for shot in written[-2:]:
                _compact(shot)
            page.set_viewport_size(VIEWPORT)
        browser.close()
    return written


def _compact(path: Path) -> None:
    """256 colours, undithered: a page's flat colours and text stay sharp at a third of the size."""
    from PIL import Image

    with Image.open(path) as image:
        compact = image.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE)
    compact.save(path, optimize=True)


def _shoot_phone(page, name: str, path: Path) -> Path:
    """The page as it is now (a conversation, a new invitation link), at the phone's width."""
    from tests.browser.system import PHONE_VIEWPORT, horizontal_overflow

    page.set_viewport_size(PHONE_VIEWPORT)
    if name in CHARTS:
        page.reload()
        page.wait_for_selector(".uplot")
    page.wait_for_timeout(300)  # the reflow's paint
    if (extra := horizontal_overflow(page)) > 0:
        raise RuntimeError(f"{name} is {extra}px wider than a phone's window")
    if name in SECTIONS:
        page.locator(SECTIONS[name]).screenshot(path=path)
    else:
        page.screenshot(path=path, full_page=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "docs" / "screenshots")
    args = parser.parse_args(argv)
    from django.db import connections

    from tests.browser.system import scratch_system, scratch_system_problem

    if problem := scratch_system_problem():
        parser.error(problem)
    with scratch_system("screenshots") as system:
        links = prepare(system)
        connections.close_all()  # Playwright's loop must not meet an open connection
        for path in shoot(system, args.out, links):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
