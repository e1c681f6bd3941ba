"""The standalone server end to end: a real engine on CPU with a tiny checkpoint, behind Starlette."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
import uvicorn

from gpuworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from gpuworker.replica.app import ServerConfig, build_app
from gpuworker.replica.engine_holder import EngineHolder
from tests.gpuworker.replica_metrics import tenant_figures
from tests.gpuworker.streaming import stream_in_thread

TOKEN = "s3cret"


def _bound_socket() -> socket.socket:
    """A socket bound to a free port and kept: a port only looked up could be taken before the
    server binds it (the daemon hands its replicas bound sockets for the same reason)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def _serving(config: ServerConfig):
    """A real uvicorn on 127.0.0.1 in a thread of this process, so tests can look into the engine."""
    app = build_app(config)
    sock = _bound_socket()
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
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
    try:
        yield base, app
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def _config(tiny_checkpoint, **overrides) -> ServerConfig:
    return ServerConfig(
        model=str(tiny_checkpoint("llama")), served_model_name="tiny", token=TOKEN, max_model_len=1024, **overrides
    )


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, tiny_checkpoint):
    """A server whose engine steps in a thread of this process, or in a process of its own."""
    with _serving(_config(tiny_checkpoint, engine_process=request.param == "process")) as running:
        yield running


def _generated(client: httpx.Client) -> int:
    """Tokens the engine has generated so far (its own count, wherever it runs)."""
    return client.get("/stats").json()["num_generated_tokens"]


def _client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def _sse(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_openai_sdk_chat_stream_completions_models(server):
    openai = pytest.importorskip("openai")
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN)

    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        temperature=0.8,
        seed=1,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 10
    assert chat.usage.model_extra["gpu_time_s"] > 0
    assert len(chat.choices[0].logprobs.content) == 5
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2

    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    # Greedy: the streamed text equals the non-streamed one.
    whole = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert whole.choices[0].message.content == text

    completion = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert len(completion.choices[0].logprobs.tokens) == 4
    assert completion.usage.completion_tokens == 4

    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_a_chat_stream_sends_no_empty_deltas(server):
    """Tokens that are no text yet (bytes of a split character: the tiny model's byte-level
    vocabulary makes many) send nothing; OpenAI's shape stays: the first chunk has the role, the
    last its finish_reason, the text adds up."""
    openai = pytest.importorskip("openai")
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN)
    request = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=64,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    chunks = list(client.chat.completions.create(stream=True, **request))
    deltas = [c.choices[0] for c in chunks]
    assert deltas[0].delta.role == "assistant" and deltas[0].finish_reason is None
    assert deltas[-1].finish_reason == "length"
    assert [d for d in deltas[1:-1] if not d.delta.content] == []
    assert all(d.finish_reason is None for d in deltas[:-1])
    whole = client.chat.completions.create(**request)
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content


def test_completion_stream_ends_with_done_and_usage(server):
    base, _ = server
    with _client(base) as client:
        with client.stream(
            "POST",
            "/v1/completions",
            json={
                "prompt": "abc",
                "max_tokens": 5,
                "stream": True,
                "ignore_eos": True,
                "n": 2,
                "temperature": 1.0,
                "stream_options": {"include_usage": True},
            },
        ) as response:
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
        health = client.get("/health").json()
        assert health["status"] == "ready"
        # How long each start-up stage took, for operators and bench/load_time.py.
        assert {"weights", "kv_cache", "engine_s"} <= set(health["load_timings"])
        # The engine's sizes: CPU defaults for the batch limits, the pool from the CPU's budget.
        limits = health["limits"]
        assert (limits["max_num_seqs"], limits["max_num_batched_tokens"], limits["max_model_len"]) == (256, 8192, 1024)
        assert limits["kv_cache_tokens"] >= 1024
        assert health["load_started_at"] > 0
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
    assert value(after, "vllm:e2e_request_latency_seconds_count") > value(
        before, "vllm:e2e_request_latency_seconds_count"
    )
    assert stats["state"] == "ready" and stats["running"] == 0 and stats["load_progress"] == 1.0


def test_the_tenancy_headers_reach_the_engine_and_its_per_tenant_service_shows_in_metrics(server):
    from gpuworker.contract.tenancy import tenancy_headers

    base, _ = server
    with _client(base) as client:
        body = {"prompt": "x", "max_tokens": 3, "ignore_eos": True}
        for tenant_id, weight, batch in ((41, 1.0, False), (42, 2.0, True)):
            answer = client.post(
                "/v1/completions", json=body, headers=tenancy_headers(tenant_id=tenant_id, weight=weight, batch=batch)
            )
            assert answer.status_code == 200
        metrics = client.get("/metrics").text
        bad_weight = client.post("/v1/completions", json=body, headers={"x-gpuserve-tenant-weight": "heavy"})
        bad_priority = client.post("/v1/completions", json=body, headers={"x-gpuserve-priority": "urgent"})
        bad_zero = client.post("/v1/completions", json=body, headers={"x-gpuserve-tenant-weight": "0"})

    served, weights = tenant_figures(metrics)
    # Its prompt once, its 3 output tokens twice each (the first sampled by the prefill's last token).
    prompt_tokens = served["41", "interactive"] - 2 * 3 + 1
    assert prompt_tokens >= 1 and served["42", "batch"] == served["41", "interactive"]
    assert weights["41"] == 1.0 and weights["42"] == 2.0
    assert bad_weight.status_code == 400 and "x-gpuserve-tenant-weight must be a number" in bad_weight.text
    assert bad_priority.status_code == 400 and "priority must be one of interactive, batch" in bad_priority.text
    assert bad_zero.status_code == 400 and "tenant_weight must be greater than 0" in bad_zero.text


def test_stats_carry_recent_latency_percentiles_that_the_heartbeat_contract_keeps(tiny_checkpoint):
    from gpuworker.contract.heartbeat import REPLICA_FIGURES, parse_heartbeat

    with _serving(_config(tiny_checkpoint)) as (base, _), _client(base) as client:
        idle = client.get("/stats").json()
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "y", "max_tokens": 4, "ignore_eos": True, "stream": True}
        ) as stream:
            assert _sse(stream.iter_lines())[-1] == "[DONE]"
        stats = client.get("/stats").json()
    # No sample yet: null, which a heartbeat leaves out (0 would read as a perfect latency).
    assert idle["ttft_p95_s"] is None and idle["itl_p95_s"] is None
    assert 0 < stats["ttft_p95_s"] < 60 and 0 < stats["itl_p95_s"] < 60
    # The load the gateway sheds by: nothing queued now, prompts prefilled since the idle snapshot.
    assert idle["waiting_tokens"] == stats["waiting_tokens"] == 0 and stats["prefill_tokens_per_s"] > 0
    for figures, expected in (
        (idle, {}),
        (stats, {"ttft_p95_s": stats["ttft_p95_s"], "itl_p95_s": stats["itl_p95_s"]}),
    ):
        report = {
            "replica_id": 1,
            "state": "ready",
            "endpoint_url": base,
            **{name: figures[name] for name in REPLICA_FIGURES if name in figures},
        }
        parsed = parse_heartbeat({"replicas": [report]}).replicas[0].figures
        assert parsed["prefill_tokens_per_s"] == figures["prefill_tokens_per_s"]
        assert {name: parsed[name] for name in ("ttft_p95_s", "itl_p95_s") if name in parsed} == expected


def test_bad_input_is_400_naming_the_field(server):
    base, _ = server
    with _client(base) as client:
        response = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "temperature": 5}
        )
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
    with _client(base) as client:
        generated_before = _generated(client)
        with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "a long answer please", "max_tokens": 900, "stream": True, "ignore_eos": True},
        ) as response:
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
        generated = _generated(client) - generated_before
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0
    assert generated < 900  # aborted, not run to the end


async def test_health_is_503_while_loading(tiny_checkpoint):
    app = build_app(ServerConfig(model=str(tiny_checkpoint("llama"))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        # The lifespan has not started the load yet: the server answers, but is loading.
        response = await client.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "loading"
        assert response.json()["progress"] == 0.0
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


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_idle(client: httpx.Client) -> dict:
    deadline = time.monotonic() + 30  # returns once idle: generous for a loaded machine
    while time.monotonic() < deadline:
        stats = client.get("/stats").json()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["in_flight"] == 0:
            break
        time.sleep(0.02)
    return stats


def test_disconnect_of_non_streaming_request_aborts_it(server):
    base, app = server
    with _client(base) as client:
        generated_before = _generated(client)
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            client.post(
                "/v1/completions", json={"prompt": "a long answer please", "max_tokens": 1000, "ignore_eos": True}
            )
    with _client(base) as client:
        stats = _wait_idle(client)
        generated = _generated(client) - generated_before
    assert stats["running"] == 0 and stats["kv_cache_usage"] == 0.0 and stats["in_flight"] == 0
    assert 0 < generated < 1000  # it ran, and was aborted rather than run to the end


def test_a_caller_can_ask_whether_its_request_started_and_its_prompt_tokens(server):
    base, _ = server
    with _client(base) as client:
        never = {"request_id": "req_never_sent", "started": False, "prompt_tokens": 0, "cached_prompt_tokens": 0}
        assert client.get("/requests/req_never_sent").json() == never
        whole = client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"x-request-id": "req_whole"}
        ).json()
        answer = client.get("/requests/req_whole").json()
        # The prompt tokens it took, for a caller whose client left before the usage came back.
        assert answer["started"] is True and answer["prompt_tokens"] == whole["usage"]["prompt_tokens"] > 0
        with client.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1, "stream": True},
            headers={"x-request-id": "req_stream"},
        ) as response:
            response.read()
            assert response.headers["x-prompt-tokens"] == str(whole["usage"]["prompt_tokens"])
        assert client.get("/requests/req_stream").json()["started"] is False  # its caller saw the tokens
    assert httpx.get(f"{base}/requests/req_whole").status_code == 401


def test_a_started_whole_answer_says_its_cached_prompt_tokens(server):
    """A caller whose client left before the answer records the cached count the usage would
    have reported, as a stream's header gives it."""
    base, _ = server
    body = {"prompt": "a long prompt asked for whole, twice " * 6, "max_tokens": 1}
    with _client(base) as client:
        for caller_request_id in ("req_fills_cache", "req_reads_cache"):
            answered = client.post("/v1/completions", json=body, headers={"x-request-id": caller_request_id})
        usage = answered.json()["usage"]
        answer = client.get("/requests/req_reads_cache").json()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert answer["cached_prompt_tokens"] == cached > usage["prompt_tokens"] // 2
    assert answer["prompt_tokens"] == usage["prompt_tokens"]


def test_a_stream_says_its_cached_prompt_tokens_before_its_first_chunk(server):
    """The prefix cache is matched when the request is first scheduled: the stream's headers
    already carry the cached count its final usage reports."""
    base, _ = server
    body = {
        "prompt": "the same long prompt, sent twice " * 8,
        "max_tokens": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with _client(base) as client:
        for _ in range(2):  # the second finds the first's blocks in the prefix cache
            with client.stream("POST", "/v1/completions", json=body) as response:
                events = _sse(response.iter_lines())
    usage = events[-2]["usage"]
    assert response.headers["x-prompt-tokens"] == str(usage["prompt_tokens"])
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert response.headers["x-cached-prompt-tokens"] == str(cached) and cached > usage["prompt_tokens"] // 2


def _stream_in_thread(base: str, body: dict):
    return stream_in_thread(f"{base}/v1/completions", body, TOKEN)


def test_drain_refuses_new_requests_and_lets_streams_finish(tiny_checkpoint):
    with _serving(_config(tiny_checkpoint)) as (base, app):
        thread, result = _stream_in_thread(
            base, {"prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True, "logprobs": 0}
        )
        assert result["first"].wait(10)
        with _client(base) as client:
            assert client.post("/drain", json={"timeout_s": 60}).json() == {"running": 1}
            assert thread.is_alive()  # still streaming while the replica drains
            health = client.get("/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "replica_draining"
            thread.join(60)
            assert client.post("/drain", json={"timeout_s": -1}).status_code == 400
            # The client has read [DONE]; the server's side of the response ends just after.
            idle = _wait_idle(client)
        events = result["events"]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        # None lost: every token's logprob came, in chunks of one token or more (a chunk joins the
        # steps its stream fell behind on).
        assert sum(len(c["logprobs"]["tokens"]) for e in events[:-1] for c in e["choices"]) == 200
        assert idle["in_flight"] == 0 and not app.state.holder.drain_expired


def test_drain_timeout_ends_requests_with_an_error(tiny_checkpoint):
    with _serving(_config(tiny_checkpoint)) as (base, app):
        thread, result = _stream_in_thread(
            base, {"prompt": "go", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        )
        whole: dict = {}
        whole_thread = threading.Thread(
            target=lambda: whole.update(
                response=_client(base).post(
                    "/v1/completions", json={"prompt": "also", "max_tokens": 1000, "ignore_eos": True}
                )
            ),
            daemon=True,
        )
        whole_thread.start()
        assert result["first"].wait(10)
        with _client(base) as client:
            deadline = time.monotonic() + 5
            while client.get("/stats").json()["running"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.post("/drain", json={"timeout_s": 0.2}).json() == {"running": 2}
            thread.join(10)
            whole_thread.join(10)
            stats = _wait_idle(client)
        events = result["events"]
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "replica_draining" and "drain timeout" in events[-2]["error"]["message"]
        assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
        assert whole["response"].status_code == 503
        assert whole["response"].json()["error"]["code"] == "replica_draining"
        assert stats["kv_cache_usage"] == 0.0 and stats["in_flight"] == 0


def test_queue_time_histogram_is_filled_from_first_scheduled_time():
    holder = EngineHolder(ServerConfig(model="unused"))
    output = RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        finished=True,
        num_cached_tokens=0,
        outputs=[CompletionOutput(index=0, text="ab", token_ids=[3, 4], finish_reason="length")],
        metrics=RequestMetrics(
            arrival_time=100.0,
            first_token_time=100.5,
            finish_time=101.0,
            gpu_time_s=0.1,
            num_preemptions=0,
            first_scheduled_time=100.25,
        ),
    )
    holder.record_finished(output, 2)
    text = holder.metrics.render().decode()
    assert _value(text, "vllm:generation_tokens_total") == 2
    assert _value(text, "vllm:request_queue_time_seconds_count") == 1
    assert _value(text, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert _value(text, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)


def test_load_progress_comes_from_the_weights_loader(tiny_checkpoint):
    class Recording(EngineHolder):
        def _on_weights_progress(self, fraction: float) -> None:
            super()._on_weights_progress(fraction)
            seen.append(self.load_progress)

    seen: list[float] = []
    holder = Recording(ServerConfig(model=str(tiny_checkpoint("llama")), max_model_len=64))
    holder._load()  # the load thread's body, run here
    try:
        assert holder.state == "ready" and holder.load_progress == 1.0
        assert len(seen) > 3 and seen == sorted(seen) and 0.05 < seen[0] and seen[-1] == pytest.approx(0.9)
    finally:
        holder.shutdown()


def test_kv_cache_dtype_reaches_the_engine(tiny_checkpoint):
    # `serve --kv-cache-dtype fp8` builds this ServerConfig; the engine it loads keeps an FP8 cache.
    holder = EngineHolder(ServerConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, kv_cache_dtype="fp8"))
    holder._load()  # the load thread's body, run here
    try:
        assert holder.state == "ready", holder.error
        assert holder.engine.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    finally:
        holder.shutdown()


def test_allow_long_context_reaches_the_engine(tiny_checkpoint):
    # `serve --max-model-len 1536 --allow-long-context` on a model of 1,024 positions.
    path = str(tiny_checkpoint("llama"))
    refused = EngineHolder(ServerConfig(model=path, max_model_len=1536))
    refused._load()
    assert refused.state != "ready" and "allow_long_context" in str(refused.error)
    holder = EngineHolder(ServerConfig(model=path, max_model_len=1536, allow_long_context=True))
    holder._load()
    try:
        assert holder.state == "ready", holder.error
        assert holder.engine.engine.config.max_model_len == 1536
    finally:
        holder.shutdown()


def test_the_scheduling_policy_reaches_the_engine(tiny_checkpoint):
    # `serve --scheduling fcfs` builds this ServerConfig; the engine it loads admits in arrival order.
    holder = EngineHolder(ServerConfig(model=str(tiny_checkpoint("llama")), max_model_len=64, scheduling="fcfs"))
    holder._load()  # the load thread's body, run here
    try:
        assert holder.state == "ready", holder.error
        assert holder.engine.engine.config.scheduling == "fcfs"
        assert not holder.engine.engine.scheduler.waiting.fair
    finally:
        holder.shutdown()


def _env_without_token() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSERVE_WORKER_TOKEN", "GPUWORKER_TOKEN")}
    # A tiny model gains nothing from threads; OpenMP threads spinning on a busy machine cost 20x.
    return {**env, "OMP_NUM_THREADS": "1"}


def _start_cli_serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`python -m gpuworker serve ARGS` on a socket bound here and handed over, as the daemon does
    (--fd); returns the process and its base URL."""
    sock = _bound_socket()
    port = sock.getsockname()[1]
    with sock:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpuworker",
                "serve",
                *args,
                "--token",
                TOKEN,
                "--fd",
                str(sock.fileno()),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=_env_without_token(),
            pass_fds=(sock.fileno(),),
        )
    return process, f"http://127.0.0.1:{port}"


def _wait_healthy(client: httpx.Client, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.stdout.read().decode()
        time.sleep(0.1)
    pytest.fail("the replica never became healthy")


@pytest.mark.slow
def test_cli_serve_subprocess_drains_on_sigterm(tiny_checkpoint):
    """`python -m gpuworker serve` starts and serves; SIGTERM drains (503 for new requests, the stream
    in flight finishes) and the process then exits 0."""
    process, base = _start_cli_serve(
        [
            "--model",
            str(tiny_checkpoint("llama")),
            "--served-model-name",
            "cli",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "6",
            "--max-num-batched-tokens",
            "96",
            "--drain-timeout",
            "60",
        ]
    )
    try:
        with _client(base) as client:
            _wait_healthy(client, process, timeout=60)
            response = client.post(
                "/v1/completions", json={"model": "cli", "prompt": "hey", "max_tokens": 3, "ignore_eos": True}
            )
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
            assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 512
            limits = client.get("/health").json()["limits"]
            assert (limits["max_num_seqs"], limits["max_num_batched_tokens"]) == (6, 96)
            thread, result = _stream_in_thread(
                base, {"prompt": "go", "max_tokens": 500, "stream": True, "ignore_eos": True}
            )
            assert result["first"].wait(10)
            process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while client.get("/health").status_code != 503 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert client.get("/health").json() == {"status": "draining"}
            assert thread.is_alive()
            assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
        thread.join(60)
        assert result["events"][-1] == "[DONE]"
        assert result["events"][-2]["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _post_raw(base: str, path: str, content: bytes) -> httpx.Response:
    return httpx.post(
        f"{base}{path}",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b"[" * 100_000, None),  # deeper than the JSON parser goes: RecursionError
        (b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
        (b"[1, 2]", None),  # JSON, but not an object
        (b'{"messages": [{"role": "user", "content": "\\ud800"}], "prompt": "\\ud800"}', "messages.0.content"),
        (b'{"prompt": "\\udfff", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "prompt"),
    ],
)
def test_bodies_that_cannot_be_read_are_400_without_a_traceback(server, caplog, path, content, param):
    base, _ = server
    response = _post_raw(base, path, content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.mark.parametrize("chat", [True, False])
def test_a_lone_surrogate_given_to_the_engine_is_a_value_error(server, chat):
    """Past the body's check too (a caller of the engine itself): the tokenizer's TypeError is bad input."""
    _, app = server
    prompts = app.state.holder.engine.prompts
    with pytest.raises(ValueError, match="cannot read"):
        prompts.render_chat([{"role": "user", "content": "\ud800"}]) if chat else prompts.tokenize("a\ud800")


@pytest.mark.parametrize(("fields", "param"), [({"max_tokens": "4"}, "max_tokens"), ({"stream": "yes"}, "stream")])
def test_wrongly_typed_fields_are_400_naming_the_field(server, fields, param):
    base, _ = server
    with _client(base) as client:
        response = client.post("/v1/completions", json={"prompt": "x", **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_the_bearer_scheme_is_case_insensitive(server):
    base, _ = server
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401


@pytest.mark.parametrize("chat", [True, False])
def test_a_huge_prompt_is_prepared_while_the_replica_serves_others(server, monkeypatch, chat):
    """A prompt of megabytes takes seconds to render and tokenize. Held mid-tokenization, the
    replica still answers /health (its event loop is free) and keeps generating another request's
    stream (its engine loop is free); the huge request ends only after both."""
    base, app = server
    tokenizer = app.state.holder.engine.prompts.tokenizer
    tokenizing, release = threading.Event(), threading.Event()
    huge = "y" * (1 << 20)

    class ObservedTokenizer:
        """The real tokenizer (transformers' backend), held at the start of encoding the huge text."""

        def __init__(self, real):
            self.real = real

        def encode_batch(self, texts, *args, **kwargs):
            if any(len(text) >= 8192 for text in texts):  # the huge text, or the head it is checked by
                tokenizing.set()
                release.wait(60)
            return self.real.encode_batch(texts, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(tokenizer, "_tokenizer", ObservedTokenizer(tokenizer._tokenizer))
    order: list[str] = []
    result: dict = {}

    def send_huge() -> None:
        path, body = (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]})
            if chat
            else ("/v1/completions", {"prompt": huge})
        )
        result["response"] = _client(base).post(path, json={**body, "max_tokens": 2})
        order.append("huge")

    sender = threading.Thread(target=send_huge, daemon=True)
    with (
        _client(base) as client,
        client.stream(
            "POST", "/v1/completions", json={"prompt": "go", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        ) as stream,
    ):
        lines = stream.iter_lines()  # kept: a dropped iterator would close the stream
        assert next(lines).startswith("data: ")
        try:
            sender.start()
            assert tokenizing.wait(60), "the huge prompt was never tokenized"
            generated = _generated(client)
            assert client.get("/health").status_code == 200
            order.append("health")
            deadline = time.monotonic() + 30
            while _generated(client) < generated + 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _generated(client) >= generated + 5, "the other stream stopped while the prompt was tokenized"
            order.append("stream advanced")
        finally:
            release.set()
        sender.join(60)
    assert order == ["health", "stream advanced", "huge"]
    assert result["response"].status_code == 400
    assert result["response"].json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_cli_serve_tensor_parallel_answers_as_one_replica(tiny_checkpoint):
    """`serve --tensor-parallel-size 2` starts its second rank itself, answers as one replica with the
    unsplit model's tokens, and on SIGTERM exits 0 with its worker gone."""
    path = tiny_checkpoint("llama")
    prompt = [1, 5, 9, 200, 17]
    from gpuworker.engine import LLMEngine, SamplingParams

    expected = LLMEngine(path).generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    process, base = _start_cli_serve(["--model", str(path), "--served-model-name", "tp", "--tensor-parallel-size", "2"])
    try:
        with _client(base) as client:
            _wait_healthy(client, process, timeout=120)
            assert client.get("/health").json()["limits"]["tensor_parallel_size"] == 2
            workers = _children(process.pid)
            assert len(workers) >= 1  # the second rank (and multiprocessing's resource tracker)
            response = client.post(
                "/v1/completions",
                json={"model": "tp", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0},
            )
            assert response.status_code == 200
            assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while _running(workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(workers)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_replica_serves_a_moe_model_with_its_experts_dispatched_between_ranks(tiny_checkpoint):
    """ServerConfig.expert_parallel reaches the engine: two ranks, the all-to-all expert exchange,
    the unsplit model's tokens."""
    from gpuworker.engine import LLMEngine, SamplingParams

    path = tiny_checkpoint("mixtral")
    prompt = [1, 5, 9, 200, 17]
    expected = LLMEngine(path).generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    config = ServerConfig(
        model=str(path),
        served_model_name="tiny",
        token=TOKEN,
        max_model_len=1024,
        tensor_parallel_size=2,
        expert_parallel="all_to_all",
    )
    with _serving(config) as (base, app):
        moe = app.state.holder.engine.engine.runner.model.layers[0].mlp
        assert moe.parallel.dispatch_experts
        with _client(base) as client:
            response = client.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
            )
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == expected[0].outputs[0].text


def _children(pid: int) -> list[int]:
    """The process ids of pid's children (Linux)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(child) for child in f.read().split()]
    return children


def _running(pids: list[int]) -> list[str]:
    """The command lines of those of pids still running (not exited, not zombies)."""
    running = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except FileNotFoundError:
            continue
        if state != "Z":
            running.append(f"{pid}: {cmdline}")
    return running


@pytest.mark.slow
def test_a_replica_whose_tensor_parallel_rank_dies_turns_failed(tiny_checkpoint):
    """/health and every request then answer 503 naming the rank, so the daemon reports the replica
    failed and the gateway sends requests elsewhere, rather than each one failing in a step."""
    with _serving(_config(tiny_checkpoint, tensor_parallel_size=2)) as (base, app):
        [worker] = app.state.holder.engine.engine.workers.processes
        with _client(base) as client:
            ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            assert ok.status_code == 200
            os.kill(worker.pid, signal.SIGKILL)
            worker.join()
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert health.json()["error"] == f"tensor-parallel rank 1 (pid {worker.pid}) exited with code -9"
            refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and "rank 1" in refused.json()["error"]["message"]


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _running([pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _running([pid])


def test_a_replica_whose_engine_process_dies_fails_its_streams_and_turns_failed(tiny_checkpoint):
    """kill -9 of the engine process: the stream in flight ends at once with an error event (no
    hang), /health says failed (the daemon's restart logic takes it from there), new requests 503."""
    with _serving(_config(tiny_checkpoint, engine_process=True)) as (base, app):
        with _client(base) as client:
            engine_pid = client.get("/health").json()["engine_pid"]
            assert engine_pid is not None and engine_pid != os.getpid()
            thread, result = _stream_in_thread(
                base, {"prompt": "go", "max_tokens": 900, "stream": True, "ignore_eos": True}
            )
            assert result["first"].wait(30)
            os.kill(engine_pid, signal.SIGKILL)
            thread.join(60)
            assert not thread.is_alive(), "the stream hung after its engine died"
            assert result["events"][-1] == "[DONE]"
            error = result["events"][-2]["error"]
            assert error["type"] == "server_error" and "exited with code -9" in error["message"]
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert "exited with code -9" in health.json()["error"]
            refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and "exited with code -9" in refused.json()["error"]["message"]
            assert client.get("/stats").json()["state"] == "failed"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_replica_leaves_no_engine_process(tiny_checkpoint, sig):
    """SIGTERM (drain, then stop) or SIGKILL of `serve --engine-process`: its engine process goes too."""
    process, base = _start_cli_serve(
        ["--model", str(tiny_checkpoint("llama")), "--max-model-len", "512", "--engine-process", "--drain-timeout", "5"]
    )
    try:
        with _client(base) as client:
            _wait_healthy(client, process, timeout=120)
            engine_pid = client.get("/health").json()["engine_pid"]
            assert engine_pid in _children(process.pid)
            response = client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 3, "ignore_eos": True})
            assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
        process.send_signal(sig)
        process.wait(timeout=60)
        assert _wait_gone(engine_pid, timeout=60), f"engine process {engine_pid} outlived its replica"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_reaches_the_engine_for_chat_and_completions_streamed_or_not(server, temperature):
    """+100 on one token makes every token that one, greedy or sampled; -100 on it at the same time
    as +100 on another bans it; an id past the vocabulary is a 400 naming logit_bias."""
    base, app = server
    tokenizer = app.state.holder.engine.prompts.tokenizer
    [z], [y] = (tokenizer.encode(letter, add_special_tokens=False) for letter in "zy")
    common = {"max_tokens": 4, "temperature": temperature, "seed": 1, "ignore_eos": True}
    with _client(base) as client:
        for bias, text in (({str(z): 100}, "zzzz"), ({str(z): -100, str(y): 100}, "yyyy")):
            completion = client.post("/v1/completions", json={"prompt": "Hello", "logit_bias": bias, **common})
            assert completion.json()["choices"][0]["text"] == text
            chat = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "logit_bias": bias, **common},
            )
            assert chat.json()["choices"][0]["message"]["content"] == text
            for path, body in (
                ("/v1/completions", {"prompt": "Hello"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ):
                streamed = {**body, "logit_bias": bias, "stream": True, **common}
                with client.stream("POST", path, json=streamed) as response:
                    events = _sse(response.iter_lines())
                choices = [c for e in events[:-1] for c in e["choices"]]
                assert "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices) == text
        vocab_size = app.state.holder.engine.facts.vocab_size
        outside = client.post("/v1/completions", json={"prompt": "Hello", "logit_bias": {str(vocab_size): 1}})
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "logit_bias" and str(vocab_size) in outside.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 3, "n": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}},
            "logit_bias",
        ),
    ],
)
def test_best_of_beyond_n_and_bad_logit_bias_are_400_naming_the_field(server, path, fields, param):
    base, _ = server
    with _client(base) as client:
        response = client.post(path, json=fields)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_best_of_equal_to_n_or_1_is_served_as_n(server):
    base, _ = server
    with _client(base) as client:
        for best_of, n in ((2, 2), (1, 2), (1, 1)):
            response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": n, "best_of": best_of})
            assert response.status_code == 200 and len(response.json()["choices"]) == n


def test_stats_report_the_conversations_whose_kv_is_held(tiny_checkpoint):
    from gpuworker.contract.heartbeat import parse_heartbeat
    from gpuworker.contract.prefix_keys import PREFIX_KEY_HEADER, prefix_key_digest
    from gpuworker.daemon.supervisor import reported_prefix_keys

    held, short, unnamed = (prefix_key_digest(name) for name in ("held", "short", "unnamed"))
    prompt = "a conversation long enough to fill a few blocks " * 4
    with _serving(_config(tiny_checkpoint, host_kv_cache_bytes=1 << 20)) as (base, _), _client(base) as client:
        assert client.get("/stats").json()["prefix_keys"] == []
        for digest, text in ((held, prompt), (short, "x"), ("not-a-digest", prompt)):
            body = {"prompt": text, "max_tokens": 2, "ignore_eos": True}
            assert client.post("/v1/completions", json=body, headers={PREFIX_KEY_HEADER: digest}).status_code == 200
        client.post("/v1/completions", json={"prompt": prompt + "!", "max_tokens": 2})
        stats = client.get("/stats").json()
        health = client.get("/health").json()
        metrics = client.get("/metrics").text
    assert 'gpuserve:host_kv_cache_hits_total{model_name="tiny"} 0.0' in metrics
    # A prompt that fills no block holds nothing to report; unnamed or malformed ones are not named.
    assert stats["prefix_keys"] == [held] and unnamed not in stats["prefix_keys"]
    assert stats["host_cache_hit_rate"] == 0.0  # nothing was evicted from the GPU pool
    assert health["limits"]["host_kv_cache_tokens"] > 0
    report = {
        "replica_id": 1,
        "state": "ready",
        "endpoint_url": base,
        "prefix_keys": list(reported_prefix_keys(stats["prefix_keys"])),
    }
    assert parse_heartbeat({"replicas": [report]}).replicas[0].prefix_keys == (held,)
