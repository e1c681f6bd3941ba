"""An image part's URL turned into bytes, guarded.

data: URLs are decoded (base64 only, within the byte limit). http(s) URLs are fetched only when the
operator allows their domain, and only from public addresses: the host is resolved here, every
address it resolves to is checked, and the connection goes to the checked address itself (the
Host header and TLS name stay the host's), so a second lookup cannot swap in another address.
Redirects are followed by hand, each hop's URL checked the same way, up to a limit. The body is
read as a stream and dropped at the byte limit; the whole fetch has one deadline.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import ipaddress
import re
import socket
import ssl
from urllib.parse import urljoin, urlsplit

import httpx
import truststore

from gpuworker.contract.openai_api import ImageInput, ProtocolError
from gpuworker.replica.images import ImageLimits

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.I)
# data: URLs shorter than this are decoded on the event loop (a thread hop costs more).
INLINE_DATA_URL_CHARS = 64 << 10
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
# Cloud metadata services that sit on addresses the other checks may not catch (AWS's IPv6 one,
# Alibaba's): refused whatever the address's class.
METADATA_ADDRESSES = frozenset({"169.254.169.254", "fd00:ec2::254", "100.100.100.200", "169.254.170.2"})


def refused(image: ImageInput, message: str, status: int = 400) -> ProtocolError:
    return ProtocolError(f"{image.param}: {message}", param=image.param, code="invalid_image", status=status)


def decode_data_url(image: ImageInput, max_bytes: int) -> bytes:
    match = _DATA_URL.match(image.url)
    if match is None or not match.group("b64"):
        raise refused(image, "a data: URL must look like data:image/png;base64,<base64 bytes>")
    mime = (match.group("mime") or "").lower()
    if mime not in IMAGE_MIME_TYPES:
        raise refused(image, f"{mime or 'no media type'!r} is not a supported image type (PNG, JPEG, WebP or GIF)")
    encoded = image.url[match.end() :]
    if len(encoded) > (max_bytes + 2) // 3 * 4 + 4:
        raise refused(image, f"the image is larger than {max_bytes} bytes")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise refused(image, "the data: URL's base64 is not valid") from None
    if len(data) > max_bytes:
        raise refused(image, f"the image is {len(data)} bytes; at most {max_bytes} bytes are accepted")
    return data


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (the one lookup a fetch makes)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def address_allowed(address: str, limits: ImageLimits) -> bool:
    """Whether an image may be fetched from this address: a public unicast one, or one the operator
    allows by name."""
    if address in limits.allowed_addresses:
        return True
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if str(ip) in METADATA_ADDRESSES:
        return False
    return ip.is_global and not (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified
    )


async def _checked_target(image: ImageInput, url: str, limits: ImageLimits) -> tuple[str, str, int, str]:
    """(scheme, host, port, address) of a URL that may be fetched, or ProtocolError saying why not."""
    parts = urlsplit(url)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    if scheme not in ("http", "https") or not host:
        raise refused(image, f"{url[:100]!r} is not an http(s) URL with a host")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise refused(image, f"{url[:100]!r} has an invalid port") from None
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if not limits.domain_allowed(host):
        allowed = ", ".join(limits.allowed_domains)
        raise refused(
            image,
            f"fetching images from {host!r} is not allowed"
            + (f" (allowed domains: {allowed})" if allowed else "; this server takes images as data: URLs only"),
        )
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = await asyncio.to_thread(resolve_host, host, port)
        except OSError as exc:
            raise refused(image, f"cannot resolve {host!r}: {exc}") from None
    if not addresses or any(not address_allowed(address, limits) for address in addresses):
        raise refused(image, f"{host!r} resolves to an address images may not be fetched from (not public)")
    return scheme, host, port, addresses[0]


async def fetch_image(image: ImageInput, limits: ImageLimits) -> bytes:
    """The bytes at an http(s) image URL, fetched within the limits; ProtocolError otherwise."""
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            return await _follow(image, limits)
    except TimeoutError:
        raise refused(image, f"fetching the image took longer than {limits.fetch_timeout_s:g}s") from None
    except httpx.HTTPError as exc:
        raise refused(image, f"fetching the image failed: {type(exc).__name__}: {exc}") from None


async def _follow(image: ImageInput, limits: ImageLimits) -> bytes:
    url = image.url
    timeout = httpx.Timeout(limits.fetch_timeout_s)
    verify = tls_context(limits.ca_bundle) if limits.ca_bundle is not None else system_tls_context()
    async with httpx.AsyncClient(follow_redirects=False, timeout=timeout, trust_env=False, verify=verify) as client:
        for _ in range(limits.max_redirects + 1):
            scheme, host, port, address = await _checked_target(image, url, limits)
            parts = urlsplit(url)
            netloc = f"[{address}]" if ":" in address else address
            target = f"{scheme}://{netloc}:{port}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")
            default_port = port == (443 if scheme == "https" else 80)
            request = client.build_request(
                "GET",
                target,
                headers={"Host": host if default_port else f"{host}:{port}", "Accept": "image/*"},
                extensions={"sni_hostname": host},
            )
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise refused(image, f"{host!r} answered a redirect without a location")
                    url = urljoin(url, location)
                    continue
                if response.status_code != 200:
                    raise refused(image, f"{host!r} answered HTTP {response.status_code} for the image")
                return await _read_limited(image, response, limits.max_image_bytes)
            finally:
                await response.aclose()
    raise refused(image, f"more than {limits.max_redirects} redirects")


@functools.cache
def system_tls_context() -> ssl.SSLContext:
    """Certificates checked against the operating system's trust store (truststore: the platform's
    verifier, or OpenSSL's paths and SSL_CERT_FILE on Linux), as a browser checks them, so an
    authority the host trusts is trusted without a bundle of our own."""
    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


@functools.lru_cache(maxsize=4)
def tls_context(ca_bundle: str) -> ssl.SSLContext:
    """Certificates checked against the authorities in ca_bundle only, and against the URL's host
    (the connection goes to an address, but its TLS server name is the host's)."""
    return ssl.create_default_context(cafile=ca_bundle)


async def _read_limited(image: ImageInput, response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise refused(image, f"the image is {declared} bytes; at most {max_bytes} bytes are accepted")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise refused(image, f"the image is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def image_bytes(image: ImageInput, limits: ImageLimits) -> bytes:
    """The bytes of one image part: its data: URL decoded or its http(s) URL fetched."""
    if image.url[:5].lower() == "data:":
        if len(image.url) < INLINE_DATA_URL_CHARS:
            return decode_data_url(image, limits.max_image_bytes)
        # Megabytes of base64 take milliseconds that the event loop's other streams would wait.
        return await asyncio.to_thread(decode_data_url, image, limits.max_image_bytes)
    return await fetch_image(image, limits)
