"""The address of the client behind a request, the one used wherever an address counts (the login
lockout, the audit log): the socket's peer, or, when that peer is a trusted proxy (TRUSTED_PROXIES),
the client its X-Forwarded-For names.

Each proxy appends the address it received the request from, so only the right end of the header is
vouched for: reading from the right, every address a trusted proxy wrote is believed, and the first
that is not a trusted proxy is the client. Anything to its left came from the client and could say
anything. uvicorn's own proxy-header handling is off (--no-proxy-headers) so this is the only rule.
"""

import ipaddress
from collections.abc import Iterable

from django.conf import settings
from django.http import HttpRequest

from controlplane.env import IPNetwork

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# Longer than any address a proxy writes ("[" IPv6 with an IPv4 tail, a zone "]:" port): not parsed.
_LONGEST_ADDRESS = 100


def client_address(request: HttpRequest) -> str | None:
    """The client's address for `request` (None when the server gave no peer address)."""
    return forwarded_client_address(
        peer=request.META.get("REMOTE_ADDR"),
        forwarded_for=request.META.get("HTTP_X_FORWARDED_FOR"),
        trusted_proxies=settings.TRUSTED_PROXIES,
    )


def forwarded_client_address(
    *, peer: str | None, forwarded_for: str | None, trusted_proxies: Iterable[IPNetwork]
) -> str | None:
    trusted = tuple(trusted_proxies)
    address = parse_address(peer or "")
    if address is None:
        return None
    if not forwarded_for or not _is_trusted(address, trusted):
        return str(address)
    for hop in reversed(forwarded_for.split(",")):
        hop_address = parse_address(hop)
        if hop_address is None:
            # A trusted proxy wrote something that is no address: its sender is unknown, so the
            # proxy itself stands for it (and nothing further left can be believed).
            break
        address = hop_address
        if not _is_trusted(address, trusted):
            break
    return str(address)


def parse_address(text: str) -> IPAddress | None:
    """An address as proxies write it: bare, `[v6]`, or with a port (`1.2.3.4:80`, `[v6]:80`);
    an IPv4 address mapped into IPv6 is the IPv4 address, and an IPv6 zone is dropped. None for
    anything else."""
    text = text.strip()
    if len(text) > _LONGEST_ADDRESS:
        return None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not _is_port(rest)):
            return None
        text = host
    elif text.count(":") == 1:
        text, _, port = text.partition(":")
        if not _is_port(":" + port):
            return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address.scope_id is not None:
            # A zone names an interface of the host that received it: no part of who the client is.
            return ipaddress.IPv6Address(text.partition("%")[0])
    return address


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isascii() and text[1:].isdigit() and int(text[1:]) <= 65535


def _is_trusted(address: IPAddress, trusted: tuple[IPNetwork, ...]) -> bool:
    return any(address in network for network in trusted)
