"""Images through the replica server: refused for a text-only model (naming it) and for a bad part
(naming the part); for a model that takes images, decoded and preprocessed in the pool's processes
while another request's stream keeps its pace."""

from __future__ import annotations

import functools
import statistics
import threading
import time

import httpx
import pytest

from gpuworker.replica.images.decoding import resize_to_fit
from tests.gpuworker.replica.image_files import data_url, gradient_jpeg, image_file
from tests.gpuworker.replica.test_app import TOKEN, _config, _serving


def _client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)


def _image_chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "what is this"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with _serving(_config(tiny_checkpoint)) as running:
        yield running


def test_an_image_for_a_text_only_model_is_400_naming_the_model(server):
    base, app = server
    assert app.state.holder.image_preprocessor is None  # a text-only model preprocesses no images
    with _client(base) as client:
        response = client.post("/v1/chat/completions", json=_image_chat(data_url(image_file())))
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "model" and "'tiny'" in error["message"] and error["code"] == "model_not_multimodal"
        bad = _image_chat("file:///etc/passwd")
        response = client.post("/v1/chat/completions", json=bad)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages.0.content.1.image_url.url"
        text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 1}
        assert client.post("/v1/chat/completions", json=text_parts).status_code == 200


class _Stream:
    """A long text stream read in a thread, each token's arrival time kept."""

    def __init__(self, base: str) -> None:
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._read, args=(base,), daemon=True)
        self.thread.start()

    def _read(self, base: str) -> None:
        body = {"prompt": "go", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        with _client(base) as client, client.stream("POST", "/v1/completions", json=body) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return

    def gaps(self, start: float, end: float) -> list[float]:
        inside = [t for t in self.times if start <= t <= end]
        return [b - a for a, b in zip(inside, inside[1:])]

    def wait_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.times) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.times) >= count, "the text stream did not start"


def test_64_large_images_are_prepared_while_a_text_stream_keeps_its_pace(server, monkeypatch):
    base, app = server
    holder = app.state.holder
    received: list = []
    generate = holder.engine.generate

    def generate_with_images(prompt, params, request_id, images=None):
        received.extend(images or [])
        return generate(prompt, params, request_id)  # the tiny text model answers the text

    monkeypatch.setattr(holder.engine, "generate", generate_with_images)
    monkeypatch.setattr(holder, "image_preprocessor", functools.partial(resize_to_fit, max_side=448))
    image = data_url(gradient_jpeg(2048), "image/jpeg")
    with _client(base) as client:  # the pool's processes started, so the measure leaves start-up out
        assert client.post("/v1/chat/completions", json=_image_chat(image)).status_code == 200
    received.clear()

    stream = _Stream(base)
    stream.wait_tokens(10)
    quiet_start = time.perf_counter()
    stream.wait_tokens(len(stream.times) + 40)
    quiet_end = time.perf_counter()

    statuses: list[int] = []
    clients = [_client(base) for _ in range(16)]  # made ahead: this process serves the stream too

    def send(client: httpx.Client) -> None:
        with client:
            statuses.append(client.post("/v1/chat/completions", json=_image_chat(*[image] * 4)).status_code)

    senders = [threading.Thread(target=send, args=(client,)) for client in clients]
    busy_start = time.perf_counter()
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(300)
    busy_end = time.perf_counter()
    stream.stop.set()

    assert statuses == [200] * 16
    assert len(received) == 64 and {size for _, size in received} == {(448, 448)}
    quiet, busy = stream.gaps(quiet_start, quiet_end), stream.gaps(busy_start, busy_end)
    assert len(busy) >= 10, "the text stream stopped while the images were prepared"
    # Relative measures only (no timing thresholds): the stream is never held for a sizeable share
    # of the images' time (decoding on the event loop would hold it for all of it), and it advances
    # in steps far shorter than that time, as it does without images.
    duration = busy_end - busy_start
    assert max(busy) < duration / 4
    assert statistics.median(busy) < duration / 20
    assert statistics.median(quiet) < duration / 20
