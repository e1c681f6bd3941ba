"""The standalone server end to end: a real engine on CPU with a tiny checkpoint, behind Starlette."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from gpuworker.server import ServerConfig, build_app

TOKEN = "s3cret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    """A real uvicorn on 127.0.0.1 in a thread of this process, so tests can look into the engine."""
    app = build_app(ServerConfig(model=str(tiny_checkpoint("llama")), served_model_name="tiny",
                                 token=TOKEN, max_model_len=1024))
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        pytest.fail("the server never became ready")
    yield base, app
    uv.should_exit = True
    thread.join(timeout=10)


def _client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def _sse(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_openai_sdk_chat_stream_completions_models(server):
    openai = pytest.importorskip("openai")
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN)

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, n=2, temperature=0.8, seed=1, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 10
    assert chat.usage.model_extra["gpu_time_s"] > 0
    assert len(chat.choices[0].logprobs.content) == 5
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2

    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True},
                                            temperature=0, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # Greedy: the streamed text equals the non-streamed one.
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == text

    completion = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                           logprobs=1, extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert len(completion.choices[0].logprobs.tokens) == 4
    assert completion.usage.completion_tokens == 4

    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completion_stream_ends_with_done_and_usage(server):
    base, _ = server
    with _client(base) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "abc", "max_tokens": 5, "stream": True, "ignore_eos": True, "n": 2,
                "temperature": 1.0, "stream_options": {"include_usage": True}}) as response:
            assert response.status_code == 200
            events = _sse(response.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 10
    assert events[-2]["usage"]["gpu_time_s"] > 0
    finishes = {c["index"]: c["finish_reason"] for e in events[:-2] for c in e["choices"] if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert all("usage" not in e for e in events[:-2])


def test_health_and_metrics_move(server):
    base, _ = server
    with _client(base) as client:
        assert client.get("/health").json() == {"status": "ready"}
        before = client.get("/metrics").text
        assert "vllm:num_requests_running" in before
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
        after = client.get("/metrics").text
        stats = client.get("/stats").json()

    def value(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    assert value(after, "vllm:generation_tokens_total") >= value(before, "vllm:generation_tokens_total") + 3
    assert value(after, "vllm:prompt_tokens_total") > value(before, "vllm:prompt_tokens_total")
    assert value(after, "vllm:e2e_request_latency_seconds_count") > \
        value(before, "vllm:e2e_request_latency_seconds_count")
    assert stats["state"] == "ready" and stats["running"] == 0 and stats["load_progress"] == 1.0


def test_bad_input_is_400_naming_the_field(server):
    base, _ = server
    with _client(base) as client:
        response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "temperature": 5})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temperature"
        response = client.post("/v1/completions", json={"prompt": "x" * 50, "max_tokens": 1020})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "max_model_len" in error["message"]
        assert error["param"] == "prompt"


def test_token_is_enforced(server):
    base, _ = server
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.get(f"{base}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 401


def test_disconnect_mid_stream_frees_kv_blocks(server):
    base, app = server
    engine = app.state.holder.engine.engine
    generated_before = engine.num_generated_tokens
    with _client(base) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "a long answer please", "max_tokens": 900, "stream": True,
                "ignore_eos": True}) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(6), lines)]
            assert any(line.startswith("data: ") for line in received)
        # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            stats = client.get("/stats").json()
            if stats["running"] == 0 and stats["waiting"] == 0:
                break
            time.sleep(0.02)
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert engine.num_generated_tokens - generated_before < 900  # aborted, not run to the end


async def test_health_is_503_while_loading(tiny_checkpoint):
    app = build_app(ServerConfig(model=str(tiny_checkpoint("llama"))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        # The lifespan has not started the load yet: the server answers, but is loading.
        response = await client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status_code == 503
        async with app.router.lifespan_context(app):
            for _ in range(600):
                if (await client.get("/health")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert response.status_code == 200
            assert response.json()["choices"][0]["text"] is not None


async def test_wrong_model_path_reports_failed(tmp_path):
    app = build_app(ServerConfig(model=str(tmp_path / "missing")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        async with app.router.lifespan_context(app):
            for _ in range(200):
                body = (await client.get("/health")).json()
                if body["status"] == "failed":
                    break
                await asyncio.sleep(0.02)
        assert body["status"] == "failed" and body["error"]


def test_cli_serve_subprocess(tiny_checkpoint):
    """`python -m gpuworker serve` starts, serves, and stops cleanly on SIGTERM."""
    import signal
    import subprocess
    import sys

    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "gpuworker", "serve", "--model", str(tiny_checkpoint("llama")),
         "--port", str(port), "--served-model-name", "cli", "--max-model-len", "256", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None, process.stdout.read().decode()
            time.sleep(0.1)
        response = httpx.post(f"{base}/v1/completions", json={"model": "cli", "prompt": "hey", "max_tokens": 3,
                                                                 "ignore_eos": True}, timeout=30)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 256
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            # uvicorn shuts down gracefully (lifespan: engine stopped), then re-raises the signal.
            assert process.wait(timeout=20) in (0, -signal.SIGTERM)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
