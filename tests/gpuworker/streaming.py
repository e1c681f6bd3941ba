"""A streaming completion read in a background thread, so a test can act while it is in flight."""

from __future__ import annotations

import json
import threading

import httpx


def stream_in_thread(url: str, body: dict, token: str) -> tuple[threading.Thread, dict]:
    """POST `body` to `url` (an SSE endpoint) in a thread. result["events"] fills in as events arrive
    (JSON objects, then "[DONE]"); result["first"] is set at the first event (or at the end)."""
    result: dict = {"events": [], "first": threading.Event()}

    def run() -> None:
        try:
            with (
                httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30) as client,
                client.stream("POST", url, json=body) as response,
            ):
                result["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        result["events"].append(data if data == "[DONE]" else json.loads(data))
                        result["first"].set()
        finally:
            result["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result
