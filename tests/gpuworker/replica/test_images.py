"""Image loading, guarded: data: URLs, fetching from allowed domains only and never from
non-public addresses (after DNS, on every redirect), byte and time limits, Pillow's decoding
guarded against bombs and truncated files, and the worker pool."""

from __future__ import annotations

import asyncio
import functools
import io
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from gpuworker.contract.openai_api import ImageInput, ProtocolError
from gpuworker.replica.images import ImageLimits, sources
from gpuworker.replica.images.decoding import ImageRefused, at_detail, open_image, resize_to_fit
from gpuworker.replica.images.pool import ImagePool
from gpuworker.replica.images.preparing import prepare_images
from tests.gpuworker.replica.image_files import (
    bomb_png,
    data_url,
    gradient_jpeg,
    image_file,
    truncated_jpeg,
    two_frame_gif,
)
from tests.gpuworker.replica.tls_certificates import make_certificates

# The test server listens on a loopback address of its own, the only non-public address the
# limits below let through; 127.0.0.1 stays refused like any other loopback address.
SERVER_ADDRESS = "127.0.0.2"
PNG = image_file("PNG")


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "blue").save(out, format="PNG")
    return out.getvalue()


WIDE_PNG = _png(800, 400)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        if path == "/image.png":
            self._send(PNG)
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query)
            self.end_headers()
        elif path == "/big":
            self._send(b"\x89PNG" + b"\0" * (1 << 20))
        elif path == "/big-undeclared":
            self.send_response(200)
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\0" * (1 << 14))
        elif path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(1000):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.05)
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def image_server():
    try:
        server = ThreadingHTTPServer((SERVER_ADDRESS, 0), _Handler)
    except OSError:
        pytest.skip(f"cannot listen on {SERVER_ADDRESS}")
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


NAMES = {"images.test": [SERVER_ADDRESS], "private.test": ["10.0.0.5"], "mixed.test": ["93.184.216.34", "10.0.0.5"]}


@pytest.fixture
def resolver(monkeypatch):
    """DNS as the tests want it: the resolver the fetcher uses is outside the system under test."""
    looked_up: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        looked_up.append(host)
        if host not in NAMES:
            raise socket.gaierror(f"unknown host {host}")
        return NAMES[host]

    monkeypatch.setattr(sources, "resolve_host", resolve)
    return looked_up


def _limits(**overrides) -> ImageLimits:
    fields = dict(
        allowed_domains=("images.test", "private.test", "mixed.test", "127.0.0.1", "169.254.169.254", "10.1.2.3"),
        allowed_addresses=frozenset({SERVER_ADDRESS}),
        max_image_bytes=256 << 10,
    )
    return ImageLimits(**{**fields, **overrides})


PARAM = "messages.0.content.1.image_url"


def _fetch(url: str, limits: ImageLimits | None = None) -> bytes:
    return asyncio.run(sources.image_bytes(ImageInput(PARAM, url), limits or _limits()))


def _refusal(url: str, limits: ImageLimits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        _fetch(url, limits)
    assert caught.value.status == 400 and caught.value.param == PARAM
    assert caught.value.message.startswith(PARAM + ": ")
    return caught.value


def test_an_allowed_domain_is_fetched_from_the_address_it_resolved_to(image_server, resolver):
    assert _fetch(f"http://images.test:{image_server}/image.png") == PNG
    assert resolver == ["images.test"]  # one lookup: the connection went to the checked address


def test_a_redirect_to_an_allowed_public_path_is_followed(image_server, resolver):
    target = f"http://images.test:{image_server}/image.png"
    assert _fetch(f"http://images.test:{image_server}/redirect?{target}") == PNG


def test_fetching_is_off_unless_domains_are_allowed(image_server, resolver):
    error = _refusal(f"http://images.test:{image_server}/image.png", ImageLimits())
    assert "data: URLs only" in error.message
    assert resolver == []


def test_a_domain_not_allowed_is_refused_before_any_lookup(image_server, resolver):
    error = _refusal(f"http://elsewhere.test:{image_server}/image.png")
    assert "'elsewhere.test' is not allowed" in error.message
    assert resolver == []


@pytest.mark.parametrize("target", ["127.0.0.1", "169.254.169.254", "10.1.2.3"])
def test_a_redirect_to_a_non_public_address_is_refused(image_server, resolver, target):
    error = _refusal(f"http://images.test:{image_server}/redirect?http://{target}:{image_server}/image.png")
    assert "not public" in error.message


def test_a_redirect_to_a_domain_not_allowed_is_refused(image_server, resolver):
    error = _refusal(f"http://images.test:{image_server}/redirect?http://evil.test/x.png")
    assert "'evil.test' is not allowed" in error.message


@pytest.mark.parametrize("host", ["private.test", "mixed.test"])
def test_a_name_resolving_to_a_private_address_is_refused(image_server, resolver, host):
    error = _refusal(f"http://{host}:{image_server}/image.png")
    assert "not public" in error.message


def test_redirects_are_limited(image_server, resolver):
    url = f"http://images.test:{image_server}/image.png"
    for _ in range(3):
        url = f"http://images.test:{image_server}/redirect?{url}"
    assert _fetch(url, _limits(max_redirects=3)) == PNG
    assert "redirects" in _refusal(url, _limits(max_redirects=2)).message


@pytest.mark.parametrize("path", ["/big", "/big-undeclared"])
def test_an_oversize_body_is_refused(image_server, resolver, path):
    error = _refusal(f"http://images.test:{image_server}{path}")
    assert f"{256 << 10} bytes" in error.message


def test_a_slow_server_times_out(image_server, resolver):
    error = _refusal(f"http://images.test:{image_server}/slow", _limits(fetch_timeout_s=0.3))
    assert "longer than 0.3s" in error.message


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """The same handler over https, its certificate for images.test signed by a test CA: (port,
    the CA's PEM file)."""
    certificates = make_certificates(tmp_path_factory.mktemp("tls"), ["images.test"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates.cert_file, certificates.key_file)
    try:
        server = ThreadingHTTPServer((SERVER_ADDRESS, 0), _Handler)
    except OSError:
        pytest.skip(f"cannot listen on {SERVER_ADDRESS}")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], str(certificates.ca_file)
    server.shutdown()


NAMES["other.test"] = [SERVER_ADDRESS]  # the https server's address under a name its certificate lacks


def test_https_is_fetched_with_the_certificate_checked_against_the_host(tls_server, resolver):
    port, ca_file = tls_server
    limits = _limits(allowed_domains=("images.test", "other.test"), ca_bundle=ca_file)
    assert _fetch(f"https://images.test:{port}/image.png", limits) == PNG
    assert resolver == ["images.test"]  # connected to the checked address, TLS named the host
    # The connection goes to an address, but the certificate must name the URL's host.
    mismatch = _refusal(f"https://other.test:{port}/image.png", limits)
    assert "Hostname mismatch" in mismatch.message and "'other.test'" in mismatch.message
    # Without the test CA, the default trust refuses the server's certificate.
    untrusted = _refusal(f"https://images.test:{port}/image.png", _limits(allowed_domains=("images.test",)))
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.message


def test_without_a_bundle_https_trusts_the_operating_systems_authorities(tls_server, resolver, monkeypatch):
    """An authority the host trusts (here OpenSSL's SSL_CERT_FILE, as an operator's installed CA would
    be) is trusted with no ca_bundle; certifi's list alone would refuse the test CA."""
    port, ca_file = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", ca_file)
    assert _fetch(f"https://images.test:{port}/image.png", _limits(allowed_domains=("images.test",))) == PNG


@pytest.mark.parametrize(
    "target", ["https://127.0.0.1/x.png", "http://169.254.169.254/latest/meta-data", "https://10.1.2.3/x.png"]
)
def test_an_https_redirect_to_a_non_public_address_is_refused(tls_server, resolver, target):
    port, ca_file = tls_server
    error = _refusal(f"https://images.test:{port}/redirect?{target}", _limits(ca_bundle=ca_file))
    assert "not public" in error.message


def test_a_ca_bundle_that_is_no_file_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="ca_bundle"):
        ImageLimits(ca_bundle=str(tmp_path / "missing.pem"))


@pytest.mark.parametrize(
    "address, public",
    [
        ("93.184.216.34", True),
        ("2606:2800:220:1:248:1893:25c8:1946", True),
        ("127.0.0.1", False),
        ("::1", False),
        ("10.0.0.1", False),
        ("172.16.5.4", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),
        ("fe80::1", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("0.0.0.0", False),
        ("100.100.100.200", False),
        ("fd00:ec2::254", False),
        ("::ffff:127.0.0.1", False),
    ],
)
def test_only_public_addresses_are_fetched_from(address, public):
    assert sources.address_allowed(address, ImageLimits()) is public


def test_data_urls_are_decoded_within_the_limits():
    assert _fetch(data_url(PNG)) == PNG
    assert "base64" in _refusal("data:image/png;base64,@@@").message
    assert "not a supported image type" in _refusal(data_url(PNG, "text/html")).message
    assert "data:image/png;base64" in _refusal("data:image/png,rawbytes").message
    assert "bytes" in _refusal(data_url(b"\0" * (300 << 10))).message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_each_format_decodes(fmt):
    assert open_image(image_file(fmt, (40, 30)), 10**6).size == (40, 30)


def test_a_gif_gives_its_first_frame():
    assert open_image(two_frame_gif(), 10**6).getpixel((3, 3)) == (255, 0, 0)


@pytest.mark.parametrize("size", [(9000, 9000), (100_000, 100_000)])
def test_a_decompression_bomb_is_refused_from_its_header(size):
    with pytest.raises(ImageRefused, match="pixels"):
        open_image(bomb_png(*size), 8192 * 8192)


def test_a_truncated_jpeg_is_refused():
    with pytest.raises(ImageRefused, match="truncated"):
        open_image(truncated_jpeg(), 10**6)


def test_what_is_not_an_image_is_refused():
    with pytest.raises(ImageRefused, match="not a PNG, JPEG, WebP or GIF"):
        open_image(b"<html></html>", 10**6)


def _sleep_then_resize(image, detail, seconds):
    time.sleep(seconds)
    return resize_to_fit(image, detail)


@pytest.fixture(scope="module")
def pool():
    pool = ImagePool(workers=2)
    yield pool
    pool.shutdown()


def test_the_pool_decodes_and_resizes_in_order_and_names_a_bad_image(pool):
    images = [(ImageInput(f"p{i}", "data:"), gradient_jpeg(512 + 64 * i)) for i in range(4)]
    results = asyncio.run(pool.preprocess(resize_to_fit, images, max_pixels=10**7, budget_s=60))
    assert [size for _, size in results] == [
        (1024, 1024) if 512 + 64 * i > 1024 else (512 + 64 * i,) * 2 for i in range(4)
    ]
    low = asyncio.run(
        pool.preprocess(
            resize_to_fit, [(ImageInput("p", "data:", "low"), gradient_jpeg(2048))], max_pixels=10**7, budget_s=60
        )
    )
    assert low[0][1] == (512, 512)
    bad = images[:1] + [(ImageInput("messages.0.content.3.image_url", "data:"), bomb_png(9000, 9000))]
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(pool.preprocess(resize_to_fit, bad, max_pixels=10**7, budget_s=60))
    assert caught.value.param == "messages.0.content.3.image_url" and caught.value.status == 400


def test_the_pool_refuses_a_request_over_its_budget(pool):
    slow = functools.partial(_sleep_then_resize, seconds=5)
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(pool.preprocess(slow, [(ImageInput("p", "data:"), PNG)], max_pixels=10**6, budget_s=0.2))
    assert caught.value.status == 503 and caught.value.code == "image_preprocessing_timeout"


def test_a_text_only_model_is_named_and_the_count_is_limited(pool):
    images = [ImageInput(f"messages.0.content.{i}.image_url", data_url(PNG)) for i in range(3)]
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(prepare_images(images, model_name="tiny", preprocess=None, limits=ImageLimits(), pool=pool))
    assert caught.value.param == "model" and "'tiny'" in caught.value.message
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(
            prepare_images(
                images, model_name="v", preprocess=resize_to_fit, limits=ImageLimits(max_images=2), pool=pool
            )
        )
    assert caught.value.param == "messages.0.content.2.image_url" and caught.value.code == "too_many_images"
    done = asyncio.run(
        prepare_images(images, model_name="v", preprocess=resize_to_fit, limits=ImageLimits(), pool=pool)
    )
    assert [size for _, size in done] == [(64, 48)] * 3


def test_limits_refuse_bad_settings():
    with pytest.raises(ValueError, match="allowed_domains"):
        ImageLimits(allowed_domains=("http://x.test/",))
    with pytest.raises(ValueError, match="max_images"):
        ImageLimits(max_images=0)
    with pytest.raises(ValueError, match="low_detail_pixels: must be at least 1"):
        ImageLimits(low_detail_pixels=0)
    assert ImageLimits(allowed_domains=("*.Example.com",)).domain_allowed("img.example.com")
    assert not ImageLimits(allowed_domains=("example.com",)).domain_allowed("badexample.com")


def test_a_warmed_pool_has_its_workers_running():
    pool = ImagePool(workers=2)
    try:
        pool.warm()
        deadline = time.monotonic() + 60
        while len(pool._pool()._processes) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool._pool()._processes) == 2
    finally:
        pool.shutdown()


def test_the_pixel_limit_refuses_an_image_naming_its_part(pool):
    images = [
        ImageInput(f"messages.0.content.{i}.image_url", data_url(gradient_jpeg(side), "image/jpeg"))
        for i, side in [(1, 64), (2, 200)]
    ]
    limits = ImageLimits(max_image_pixels=100 * 100)
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(prepare_images(images, model_name="v", preprocess=resize_to_fit, limits=limits, pool=pool))
    assert caught.value.param == "messages.0.content.2.image_url" and caught.value.code == "invalid_image"
    assert "200x200" in caught.value.message and "at most 10000 pixels" in caught.value.message
    [(_, size)] = asyncio.run(
        prepare_images(images[:1], model_name="v", preprocess=resize_to_fit, limits=limits, pool=pool)
    )
    assert size == (64, 64)


@pytest.mark.parametrize(("size", "budget"), [((300, 100), 1200), ((1024, 1024), 512 * 512), ((333, 777), 5000)])
def test_low_detail_scales_an_image_down_to_its_budget_keeping_its_aspect(size, budget):
    image = Image.new("RGB", size, "red")
    low = at_detail(image, "low", budget)
    (width, height), (w, h) = size, low.size
    assert w * h <= budget and w * h > budget * 0.95
    assert abs(w / h - width / height) < 0.02 * width / height
    assert at_detail(image, "high", budget) is image and at_detail(image, "auto", budget) is image
    assert at_detail(low, "low", budget) is low  # already within the budget: never scaled up
    if size == (1024, 1024):
        assert low.size == (512, 512)


def test_the_pool_brings_a_low_detail_image_to_the_limits_budget(pool):
    images = [ImageInput(f"p{i}", "data:", detail) for i, detail in enumerate(("low", "high", "auto"))]
    limits = ImageLimits(low_detail_pixels=200 * 100)
    done = asyncio.run(
        prepare_images(
            [ImageInput(image.param, data_url(WIDE_PNG), image.detail) for image in images],
            model_name="v",
            preprocess=resize_to_fit,
            limits=limits,
            pool=pool,
        )
    )
    assert [size for _, size in done] == [(200, 100), (800, 400), (800, 400)]
