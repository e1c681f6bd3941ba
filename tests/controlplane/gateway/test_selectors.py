"""The gateway's pure rule for whether a replica can be started for a waiting request."""

import pytest

from controlplane.gateway.selectors import cold_start_refusal

GB = 1024**3


@pytest.mark.parametrize(
    ("max_replicas", "largest", "reason"),
    [
        (None, 80 * GB, "it has no deployment"),
        (0, 80 * GB, "its deployment allows no replicas (max_replicas is 0)"),
        (2, None, "no worker is online"),
        (
            2,
            4 * GB,
            "it needs 8.0 GiB and no online worker has that much GPU memory (or, CPU-only, memory): "
            "the largest has 4.0 GiB",
        ),
        (1, 8 * GB, ""),  # exactly as large: it fits
        (1, 141 * GB, ""),
    ],
)
def test_cold_start_refusal(max_replicas, largest, reason):
    assert cold_start_refusal(need_bytes=8 * GB, max_replicas=max_replicas, largest_slot_bytes=largest) == reason


@pytest.mark.django_db
def test_a_key_s_grant_carries_its_plan_s_weight_and_its_batch_flag():
    from controlplane.gateway.selectors import key_grant_for
    from tests.controlplane.factories import ApiKeyFactory, PlanFactory, TenantFactory

    heavy = TenantFactory(plan=PlanFactory(fair_share_weight=5))
    nightly = ApiKeyFactory(tenant=heavy, batch_priority=True)
    plain = ApiKeyFactory(tenant=TenantFactory(plan=None))
    limits = {"default_rate_limit_per_minute": 60, "default_max_concurrent": 4}
    grant = key_grant_for(plaintext=nightly.plaintext, **limits)
    assert (grant.fair_share_weight, grant.batch_priority) == (5, True)
    grant = key_grant_for(plaintext=plain.plaintext, **limits)
    assert (grant.fair_share_weight, grant.batch_priority) == (1, False)


@pytest.mark.django_db
def test_a_models_route_takes_its_served_context_and_a_body_limit_that_follows_it(settings):
    from controlplane.gateway.selectors import routing_table
    from tests.controlplane.factories import ModelFactory

    settings.GATEWAY_REQUEST_BYTES_PER_TOKEN, settings.GATEWAY_REQUEST_BYTES_ALLOWANCE = 16, 1000
    settings.GATEWAY_MAX_REQUEST_BYTES = 1 << 30
    ModelFactory(public_name="native", context_length=8192)
    ModelFactory(public_name="shortened", context_length=8192, max_model_len=2048)
    ModelFactory(public_name="extended", context_length=8192, max_model_len=65536, allow_long_context=True)
    table = routing_table()
    limits = {name: (table[name].context_length, table[name].max_request_bytes) for name in table}
    assert limits == {
        "native": (8192, 1000 + 8192 * 16),
        "shortened": (2048, 1000 + 2048 * 16),
        "extended": (65536, 1000 + 65536 * 16),
    }


@pytest.mark.django_db
def test_a_split_model_can_start_where_a_worker_has_enough_gpus_together():
    from controlplane.gateway.selectors import routing_table
    from tests.controlplane.factories import DeploymentFactory, GpuFactory, ModelFactory, WorkerFactory

    worker = WorkerFactory(name="two-gpus")
    for index in range(2):
        GpuFactory(worker=worker, index=index, memory_total_bytes=80 * GB)
    models = {
        name: ModelFactory(public_name=name, gpu_memory_bytes=need, tensor_parallel_size=size)
        for name, need, size in [("split", 120 * GB, 2), ("whole", 120 * GB, 1), ("huge", 200 * GB, 2)]
    }
    for model in models.values():
        DeploymentFactory(model=model, desired_replicas=0, max_replicas=1)
    table = routing_table()
    assert table["split"].cannot_start == ""
    assert "the largest has 80.0 GiB" in table["whole"].cannot_start
    assert table["huge"].cannot_start == (
        "it needs 200.0 GiB over 2 GPUs of one worker and no online worker has "
        "that much GPU memory (or, CPU-only, memory): the largest has 160.0 GiB"
    )


@pytest.mark.django_db
def test_routing_sends_a_conversation_to_the_replica_whose_heartbeat_reports_its_kv():
    """Two replicas of one model, on two workers, each reporting in its heartbeat a different
    conversation held in its KV tiers, each the one prefix hashing alone would send elsewhere: each
    conversation's request goes to its holder."""
    from django.utils import timezone

    from controlplane.fleet.models import Replica
    from controlplane.fleet.services.heartbeats import worker_heartbeat
    from controlplane.gateway.replica_choice import affinity_choice
    from controlplane.gateway.selectors import ReplicaRoute, routing_table
    from gpuworker.contract.heartbeat import parse_heartbeat
    from gpuworker.contract.prefix_keys import prefix_key_digest
    from tests.controlplane.factories import DeploymentFactory, ModelFactory, ReplicaFactory, WorkerFactory

    deployment = DeploymentFactory(model=ModelFactory(public_name="chat"), desired_replicas=2)
    workers = [WorkerFactory(name=f"w{i}") for i in range(2)]
    urls = [f"http://10.0.0.{i + 1}:8000" for i in range(2)]
    replicas = [
        ReplicaFactory(deployment=deployment, worker=w, state=Replica.State.READY, endpoint_url=url)
        for w, url in zip(workers, urls)
    ]
    plain = [ReplicaRoute(r.pk, url) for r, url in zip(replicas, urls)]
    keys = [f"conversation {i} " * 8 for i in range(40)]
    # One conversation rendezvous hashing sends to each replica; each is held by the other one.
    held_by = {1 - affinity_choice(key, plain): key for key in keys}
    assert set(held_by) == {0, 1}
    for index, key in held_by.items():
        beat = {"replica_id": replicas[index].pk, "state": "ready", "endpoint_url": urls[index]}
        heartbeat = parse_heartbeat(
            {"gpus": [], "cpu": {}, "replicas": [{**beat, "prefix_keys": [prefix_key_digest(key)]}]}
        )
        worker_heartbeat(worker_id=workers[index].pk, heartbeat=heartbeat, now=timezone.now())
    routes = routing_table()["chat"].ready
    assert [route.replica_id for route in routes] == [r.pk for r in replicas]
    for index, key in held_by.items():
        assert routes[affinity_choice(key, routes)].replica_id == replicas[index].pk


@pytest.mark.django_db
def test_routes_carry_each_replicas_predicted_wait_from_a_recent_load_report_and_the_ttft_objective():
    import time

    from controlplane.fleet import heartbeat_cache
    from controlplane.fleet.models import Replica, Worker
    from controlplane.gateway.selectors import routing_table
    from tests.controlplane.factories import DeploymentFactory, ReplicaFactory, WorkerFactory

    deployment = DeploymentFactory(ttft_slo_ms=1500, model__max_image_pixels=1 << 20, model__low_detail_pixels=1 << 16)
    reported, silent = (WorkerFactory(name=name, state=Worker.State.ONLINE) for name in ("reported", "silent"))
    busy, quiet = (
        ReplicaFactory(deployment=deployment, worker=worker, state=Replica.State.READY, endpoint_url=f"http://{n}:1")
        for worker, n in ((reported, "busy"), (silent, "quiet"))
    )
    load = {"waiting_tokens": 9000, "prefill_tokens_per_s": 3000.0, "prefix_keys": ["a" * 16]}
    heartbeat_cache.store(worker_id=reported.pk, state={"received_at": time.time(), "replicas": {str(busy.pk): load}})
    # An old report says nothing of the queue now, nor of what the replica's KV tiers hold.
    old = {"received_at": time.time() - 60, "replicas": {str(quiet.pk): load}}
    heartbeat_cache.store(worker_id=silent.pk, state=old)
    route = routing_table()[deployment.model.public_name]
    assert route.ttft_objective_s == 1.5
    assert (route.max_image_pixels, route.low_detail_pixels) == (1 << 20, 1 << 16)  # what images count as
    assert {r.replica_id: r.predicted_wait_s for r in route.ready} == {busy.pk: 3.0, quiet.pk: 0.0}
    assert {r.replica_id: r.prefix_keys for r in route.ready} == {busy.pk: frozenset({"a" * 16}), quiet.pk: frozenset()}


def test_a_requests_images_are_routed_as_the_models_image_tokens_not_as_their_urls_bytes():
    import base64
    import json

    from controlplane.gateway.body_check import check_body
    from gpuworker.contract.openai_api import ChatCompletionRequest

    model = _vision_route(
        max_image_pixels=1024 * 1024,  # 1338 tokens at most an image (28 x 28 pixels a token)
        low_detail_pixels=512 * 512,  # 335
    )

    def routed_as(*images: dict) -> int:
        """The prompt tokens a chat request with some text and `images` is routed as."""
        content = [{"type": "text", "text": "Describe it. " * 100}]
        content += [{"type": "image_url", "image_url": image} for image in images]
        raw = json.dumps({"model": "eyes", "messages": [{"role": "user", "content": content}]}).encode()
        checked = check_body(raw, ChatCompletionRequest, 64, {})
        assert checked.error is None
        return model.prompt_tokens_estimate(len(raw), checked)

    text = routed_as()
    photo = "data:image/png;base64," + base64.b64encode(bytes(1 << 20)).decode()  # 1 MB, 1.4 MB as base64
    # An image whose size is not known before the replica fetches or decodes it (an http URL, a
    # data: URL without an image header) is the most tokens the model makes of one (its part's JSON
    # adds a few as text), whatever its URL's length: a data: URL's base64 is not text, nor is an
    # http URL nothing.
    for image, tokens in (
        ({"url": photo}, 1338),
        ({"url": "https://example.com/cat.png"}, 1338),
        ({"url": photo, "detail": "low"}, 335),
        ({"url": "https://example.com/cat.png", "detail": "high"}, 1338),
    ):
        assert tokens <= routed_as(image) - text <= tokens + 16, image
    assert 2 * 1338 + 335 <= routed_as({"url": photo}, {"url": photo}, {"url": photo, "detail": "low"}) - text


def _vision_route(**fields):
    from decimal import Decimal

    from controlplane.gateway.selectors import ModelRoute

    return ModelRoute(
        model_id=1,
        public_name="eyes",
        kind="vision",
        price_per_request=Decimal("0.01"),
        created=0,
        context_length=32768,
        max_request_bytes=64 << 20,
        ready=(),
        loading=False,
        **fields,
    )


def _image_tokens_routed(model, image: dict) -> int:
    """The prompt tokens a chat request's image part is routed as: the request's, less the same
    request's without it."""
    import json

    from controlplane.gateway.body_check import check_body
    from gpuworker.contract.openai_api import ChatCompletionRequest

    def routed_as(*images: dict) -> int:
        content = [{"type": "text", "text": "Describe it. " * 100}]
        content += [{"type": "image_url", "image_url": image} for image in images]
        raw = json.dumps({"model": "eyes", "messages": [{"role": "user", "content": content}]}).encode()
        checked = check_body(raw, ChatCompletionRequest, 64, {})
        assert checked.error is None
        return model.prompt_tokens_estimate(len(raw), checked)

    return routed_as(image) - routed_as()


def _photo_url(fmt: str, size: tuple[int, int]) -> str:
    import base64
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(out.getvalue()).decode()}"


def test_a_data_url_image_is_routed_as_the_tokens_the_replica_makes_of_its_size():
    from gpuworker.contract.image_tokens import image_tokens

    model = _vision_route()  # the catalog's defaults: 8192 x 8192 pixels at most an image
    # 1024 x 1024: 37 x 37 tokens of 28 x 28 pixels, as the replica's preprocessing makes them
    # (tests/gpuworker/contract/test_image_tokens.py), not the 16,384 of the largest image.
    assert image_tokens(1024, 1024, "auto", model.low_detail_pixels) == 1369
    for fmt in ("PNG", "JPEG"):
        photo = _photo_url(fmt, (1024, 1024))
        assert 1369 <= _image_tokens_routed(model, {"url": photo}) <= 1369 + 16, fmt
        assert 324 <= _image_tokens_routed(model, {"url": photo, "detail": "low"}) <= 324 + 16, fmt
    wide = _photo_url("PNG", (1920, 1080))
    assert 0 <= _image_tokens_routed(model, {"url": wide}) - image_tokens(1920, 1080, "auto", 512 * 512) <= 16


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",  # its size is known only once the replica fetches it
        "data:image/png;base64," + "A" * 4000,  # no image header
        _photo_url("PNG", (1024, 1024))[:40],  # cut inside the header
        "data:image/jpeg;base64,/9j/" + "@@@@" * 100,  # not base64
    ],
)
def test_an_image_of_unknown_size_is_routed_as_the_largest_the_model_takes(url):
    from gpuworker.contract.image_tokens import MAX_IMAGE_TOKENS

    tokens = _image_tokens_routed(_vision_route(), {"url": url})
    assert MAX_IMAGE_TOKENS <= tokens <= MAX_IMAGE_TOKENS + 16
    assert 335 <= _image_tokens_routed(_vision_route(), {"url": url, "detail": "low"}) <= 335 + 16


def test_a_model_with_a_fixed_count_an_image_routes_every_image_as_that_count():
    gemma = _vision_route(family="gemma3")
    for url in ("https://example.com/cat.png", _photo_url("PNG", (1024, 1024))):
        assert 256 <= _image_tokens_routed(gemma, {"url": url}) <= 256 + 16, url
