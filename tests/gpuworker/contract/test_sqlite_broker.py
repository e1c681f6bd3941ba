"""The embedded set-up's Celery broker (gpuworker.contract.sqlite_broker), as the embedded settings
configure it (controlplane.integrations.celery_broker without REDIS_URL): several processes sending
and taking at once lose nothing, take nothing twice and never read half a message, also when a
sender is SIGKILLed mid-stream."""

import multiprocessing
import os
import signal
import sqlite3
import time
from queue import Empty

import pytest
from kombu import Connection

from controlplane import integrations
from gpuworker.contract import sqlite_broker

# Hang protection only: a healthy run takes seconds.
DEADLINE_S = 240
QUEUE = "stress"


@pytest.fixture
def broker(tmp_path) -> tuple[str, dict]:
    sqlite_broker.register()  # as controlplane.celery and the daemon's Celery app do
    return integrations.celery_broker("", tmp_path)


def _message(producer: int, n: int) -> dict:
    # A body long enough that a torn write would show: its text repeats its own id.
    return {"producer": producer, "n": n, "text": f"{producer}:{n};" * 200}


def _produce(url: str, options: dict, producer: int, count: int, start) -> None:
    start.wait()
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        for n in range(count):
            queue.put(_message(producer, n))
        queue.close()


def _consume(url: str, options: dict, start, taken, expected: int, results) -> None:
    start.wait()
    got, torn = [], 0
    deadline = time.monotonic() + DEADLINE_S
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        while taken.value < expected and time.monotonic() < deadline:
            try:
                message = queue.get(block=True, timeout=0.2)
            except Empty:
                continue
            body = message.payload
            torn += body != _message(body["producer"], body["n"])
            got.append((body["producer"], body["n"]))
            message.ack()
            with taken.get_lock():
                taken.value += 1
        queue.close()
    results.put((got, torn))


def test_concurrent_producers_and_consumers_across_processes_lose_nothing_and_take_nothing_twice(broker):
    url, options = broker
    producers, consumers, per_producer = 4, 3, 250
    expected = producers * per_producer
    context = multiprocessing.get_context("fork")
    start, taken, results = context.Event(), context.Value("i", 0), context.Queue()
    processes = [
        context.Process(target=_produce, args=(url, options, p, per_producer, start)) for p in range(producers)
    ]
    processes += [
        context.Process(target=_consume, args=(url, options, start, taken, expected, results)) for _ in range(consumers)
    ]
    for process in processes:
        process.start()
    start.set()  # all at once, on a file none of them has opened yet
    outcomes = []
    for _ in range(consumers):
        try:
            outcomes.append(results.get(timeout=DEADLINE_S + 30))
        except Empty:
            break
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    assert [process.exitcode for process in processes] == [0] * len(processes), "a producer or consumer crashed"
    got = [item for items, _ in outcomes for item in items]
    assert sum(torn for _, torn in outcomes) == 0
    assert len(got) == len(set(got)), "a message was taken twice"
    assert set(got) == {(p, n) for p in range(producers) for n in range(per_producer)}
    assert all(items for items, _ in outcomes), "a consumer took nothing: the load was not shared"


def _produce_forever(url: str, options: dict) -> None:
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        for n in range(10**9):
            queue.put(_message(0, n))


def test_a_sender_killed_mid_stream_leaves_only_whole_messages_in_order(broker):
    url, options = broker
    context = multiprocessing.get_context("fork")
    sender = context.Process(target=_produce_forever, args=(url, options))
    sender.start()
    path = sqlite_broker.database_path(url)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        try:
            with sqlite3.connect(path, timeout=30) as db:
                if db.execute("SELECT count(*) FROM message").fetchone()[0] >= 300:
                    break
        except sqlite3.OperationalError:  # not created yet
            pass
        time.sleep(0.05)
    os.kill(sender.pid, signal.SIGKILL)
    sender.join()
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        bodies = []
        while True:
            try:
                message = queue.get(block=False)
            except Empty:
                break
            bodies.append(message.payload)
            message.ack()
        queue.close()
    # Every message sent before the kill is there, whole, once and in order; nothing else.
    assert len(bodies) >= 300
    assert bodies == [_message(0, n) for n in range(len(bodies))]


def test_a_process_forked_after_connecting_uses_a_connection_of_its_own(broker):
    url, options = broker
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        queue.put({"from": "parent"})
        pid = os.fork()
        if pid == 0:  # the child sends through the channel it inherited, as a Celery pool process may
            try:
                queue.put({"from": "child"})
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert sorted(queue.get(timeout=5).payload["from"] for _ in range(2)) == ["child", "parent"]
        assert queue.qsize() == 0
        queue.close()


def test_size_and_purge_count_only_their_own_queue(broker):
    url, options = broker
    with Connection(url, transport_options=options) as conn:
        channel = conn.default_channel
        for queue, count in (("a", 3), ("b", 2)):
            channel.queue_declare(queue)
            for n in range(count):
                conn.SimpleQueue(queue).put({"n": n})
        assert channel.queue_declare("a", passive=True).message_count == 3
        assert channel.queue_purge("a") == 3
        assert channel._size("a") == 0 and channel._size("b") == 2


@pytest.mark.parametrize("url", ["sqlite://relative/broker.sqlite3", "sqlite:broker.sqlite3", "redis://x"])
def test_a_broker_url_without_an_absolute_path_is_refused_naming_the_form(url):
    with pytest.raises(ValueError, match=r"sqlite:///<absolute path to a file>"):
        sqlite_broker.database_path(url)
