"""How long the playground takes for an answer against the API for the same one, on the demo model:

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpuserve REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python -m bench.playground [--tokens 128] [--runs 5] [--model demo-tiny]

It starts the system the browser tests use (tests/browser/system.py: the web server, Celery and a
CPU daemon serving the demo models) in a throwaway database (`<name>_bench`), then times, alternately,
`--runs` streamed API requests (httpx, from sending to the last SSE event) and `--runs` playground
answers in headless Chromium (from pressing Send to the status reading "done", measured in the page),
each for `--tokens` completion tokens at temperature 0 (`demo-tiny`'s random weights never end an
answer early; a real model may, and the run then says so). A warm-up of each is left out. Prints each run
and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

# Long enough an answer at temperature 0 for a real model as for the random demo-tiny.
PROMPT = "Count from 1 to 1000, one number per line."
# Clicks Send and resolves with the milliseconds until the status says the answer is done.
_TIME_ANSWER = """() => new Promise((resolve) => {
  const started = performance.now();
  let streaming = false;  // the previous answer's "done" must not count
  const observer = new MutationObserver(() => {
    const now = document.getElementById("playground-status");
    streaming = streaming || now.dataset.state === "streaming";
    if (streaming && (now.dataset.state === "done" || now.dataset.state === "failed")) {
      observer.disconnect(); resolve([performance.now() - started, now.dataset.state, now.textContent]);
    }
  });
  observer.observe(document.getElementById("playground"), {subtree: true, childList: true, attributes: true});
  document.getElementById("playground-send").click();
})"""


def api_seconds(system, *, model: str, tokens: int) -> float:
    import httpx

    body = {
        "model": model,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": PROMPT}],
    }
    started = time.perf_counter()
    completion_tokens = None
    with httpx.stream(
        "POST",
        f"{system.url}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"Authorization": f"Bearer {system.seeded.api_key}"},
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line and '"completion_tokens"' in line:
                completion_tokens = int(line.split('"completion_tokens":', 1)[1].split(",", 1)[0].strip(" }"))
    elapsed = time.perf_counter() - started
    if completion_tokens != tokens:
        raise RuntimeError(f"the API answer had {completion_tokens} tokens, not {tokens}")
    return elapsed


def playground_seconds(page, *, tokens: int, frames: list[int]) -> float:
    """One answer to PROMPT alone: a new conversation each time, so every run sends the same prompt."""
    from playwright.sync_api import expect

    if page.locator("#playground-clear").count():
        page.click("#playground-clear")
        expect(page.locator("#playground-status")).to_have_attribute("data-state", "idle")
    page.fill("#id_message", PROMPT)
    page.fill("#id_max_tokens", str(tokens))
    frames.clear()
    elapsed_ms, state, text = page.evaluate(_TIME_ANSWER)
    if state != "done" or f"{tokens} completion tokens" not in text:
        raise RuntimeError(f"the playground answer did not finish with {tokens} tokens: {text!r}")
    return elapsed_ms / 1000


def measure(system, *, model: str, tokens: int, runs: int) -> tuple[list[float], list[float]]:
    from django.urls import reverse
    from playwright.sync_api import expect, sync_playwright

    from tests.browser.system import VIEWPORT, launch_options, log_in

    api, playground = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(**launch_options())
        context = browser.new_context(base_url=system.url, viewport=VIEWPORT)
        context.set_default_timeout(120_000)
        page = context.new_page()
        # WebSocket messages the page receives for one answer (each one an htmx swap).
        frames: list[int] = []
        page.on("websocket", lambda socket: socket.on("framereceived", lambda payload: frames.append(len(payload))))
        log_in(page, system.login("tenant"))
        page.goto(reverse("dashboard:playground"))
        page.select_option("#id_model", model)
        page.fill("#id_temperature", "0")
        expect(page.locator("#playground-send")).to_be_enabled()
        api_seconds(system, model=model, tokens=tokens)  # warm-ups, left out
        playground_seconds(page, tokens=tokens, frames=frames)
        for run in range(runs):
            api.append(api_seconds(system, model=model, tokens=tokens))
            playground.append(playground_seconds(page, tokens=tokens, frames=frames))
            print(
                f"run {run + 1}: API {api[-1]:.3f} s, playground {playground[-1]:.3f} s "
                f"({len(frames)} WebSocket messages to the page)",
                flush=True,
            )
        browser.close()
    return api, playground


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default="demo-tiny")
    args = parser.parse_args(argv)
    from django.db import connections

    from tests.browser.system import scratch_system, scratch_system_problem

    if problem := scratch_system_problem():
        parser.error(problem)
    with scratch_system("bench") as system:
        from controlplane.fleet.models import Replica  # once scratch_system has set Django up
        from tests.integration.conftest import wait_until

        wait_until(
            lambda: Replica.objects.filter(
                deployment__model__public_name=args.model, state=Replica.State.READY
            ).exists(),
            timeout=300,
            what=f"a ready replica of {args.model}",
            fleet=system.fleet,
        )
        connections.close_all()  # Playwright's loop must not meet an open connection
        api, playground = measure(system, model=args.model, tokens=args.tokens, runs=args.runs)
    api_median, playground_median = statistics.median(api), statistics.median(playground)
    print(
        f"{args.model}, {args.tokens} tokens, median of {args.runs}: API {api_median:.3f} s, "
        f"playground {playground_median:.3f} s ({playground_median / api_median:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
