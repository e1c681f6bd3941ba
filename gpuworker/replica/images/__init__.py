"""Images of chat requests, from the request to what the model's preprocessing made of them.

`sources` turns an image part's URL into bytes: data: URLs decoded, http(s) URLs fetched only from
domains the operator allows and never from loopback, private, link-local, multicast, reserved or
cloud-metadata addresses (checked after DNS resolution and on every redirect). `decoding` opens
the bytes with Pillow, refusing formats other than PNG, JPEG, WebP and GIF, decompression bombs
(pixels counted from the header before any decoding) and truncated files, and scales a "low"
detail image down to the low-detail budget. `pool` runs decoding and the model's preprocessing in
worker processes, off the server's event loop. Every refusal is a ProtocolError naming the
request's part.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# 20 MiB an image (OpenAI's limit for an uploaded image), 16 images a request.
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGES = 16
# 64 megapixels: an 8192 x 8192 image; a bomb's header claims far more.
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
# An image part with "detail": "low" is scaled down to at most this many pixels before the model's
# processor sees it (OpenAI's low detail: a 512 x 512 image at a small fixed token budget).
DEFAULT_LOW_DETAIL_PIXELS = 512 * 512


@dataclass(frozen=True)
class ImageLimits:
    """What a replica accepts in one request's images.

    allowed_domains: hosts whose images may be fetched by http(s) (a name allows its subdomains
    too); empty, the default: no fetching, data: URLs only. allowed_addresses: addresses fetched
    from although they are not public (an operator's internal image store; tests' local servers).
    ca_bundle: a PEM file of the certificate authorities https image servers are checked against
    (an internal store's own CA); None, the default: the operating system's trust store.
    low_detail_pixels: the most pixels an image part with "detail": "low" keeps (scaled down, its
    aspect kept, before the model's processor), so it fills fewer tokens; "high" and "auto" leave
    the resolution to the processor.
    """

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    low_detail_pixels: int = DEFAULT_LOW_DETAIL_PIXELS
    allowed_domains: tuple[str, ...] = ()
    allowed_addresses: frozenset[str] = frozenset()
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Seconds a request's images may take to fetch, decode and preprocess, all together.
    budget_s: float = 30.0
    ca_bundle: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_images", "max_image_bytes", "max_image_pixels", "low_detail_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        for name in ("fetch_timeout_s", "budget_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {getattr(self, name)}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects: must be 0 or more, got {self.max_redirects}")
        normalized = tuple(domain.strip().lower().lstrip("*").lstrip(".") for domain in self.allowed_domains)
        if any(not domain or "/" in domain or ":" in domain for domain in normalized):
            raise ValueError(
                f"allowed_domains: give host names such as 'images.example.com', got {self.allowed_domains!r}"
            )
        object.__setattr__(self, "allowed_domains", normalized)
        if self.ca_bundle is not None and not os.path.isfile(self.ca_bundle):
            raise ValueError(f"ca_bundle: {self.ca_bundle!r} is not a file (give a PEM file of CA certificates)")

    def domain_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == domain or host.endswith("." + domain) for domain in self.allowed_domains)
