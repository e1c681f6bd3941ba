"""The ASGI entry point's own handling: /static/ served by Django's static files handler."""

import asyncio

import pytest

from controlplane.asgi import application


async def _get(path: str) -> tuple[int, bytes]:
    """One GET through the ASGI app with `path` exactly as a client sent it (HTTP clients remove
    `..` segments themselves, so the scope is built by hand)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    request = [{"type": "http.request", "body": b"", "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if request:
            return request.pop()
        await asyncio.Event().wait()  # no disconnect while the answer is written

    async def send(message):
        sent.append(message)

    await application(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize("path", ["/static/../x", "/static/../../etc/passwd", "/static/css/../../manage.py"])
def test_a_static_path_leaving_the_static_folders_is_a_404(path):
    status, body = asyncio.run(_get(path))
    assert status == 404
    assert b"import" not in body and b"root:" not in body


def test_static_files_are_still_served():
    status, body = asyncio.run(_get("/static/css/app.css"))
    assert status == 200 and b".path-found" in body
