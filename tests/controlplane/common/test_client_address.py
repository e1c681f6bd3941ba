"""The rule for the client's address: the peer, unless a trusted proxy names the client in
X-Forwarded-For, read from the right (common.client_address)."""

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import RequestFactory

from controlplane.common.client_address import client_address, forwarded_client_address, parse_address
from controlplane.env import parse_networks

PROXIES = parse_networks("TRUSTED_PROXIES", "10.0.0.0/8, 2001:db8:ffff::/48, 192.0.2.1")


def _resolve(peer, forwarded_for, trusted=PROXIES):
    return forwarded_client_address(peer=peer, forwarded_for=forwarded_for, trusted_proxies=trusted)


@pytest.mark.parametrize(
    ("peer", "header", "client"),
    [
        # Nobody is trusted by default: the peer, whatever the header says.
        ("203.0.113.7", "198.51.100.1", "203.0.113.7"),
        # An untrusted peer's header is its own claim.
        ("203.0.113.7", "10.0.0.1, 192.0.2.1", "203.0.113.7"),
        # A trusted peer: the right-most address that is no trusted proxy, past a chain of them.
        ("192.0.2.1", "198.51.100.1", "198.51.100.1"),
        ("192.0.2.1", "1.1.1.1, 2.2.2.2, 198.51.100.1, 10.1.2.3, 10.9.9.9", "198.51.100.1"),
        ("10.0.0.5", "198.51.100.1, 2001:db8:ffff::7", "198.51.100.1"),
        ("2001:db8:ffff::1", "2001:db8:1::5", "2001:db8:1::5"),
        # Only trusted hops: the farthest one is where the request came from.
        ("192.0.2.1", "10.1.1.1, 10.2.2.2", "10.1.1.1"),
        # No header, or an empty one: the peer.
        ("192.0.2.1", None, "192.0.2.1"),
        ("192.0.2.1", "", "192.0.2.1"),
        # Ports and brackets as some proxies write them; IPv4 mapped into IPv6 is IPv4.
        ("192.0.2.1", "198.51.100.1:52100", "198.51.100.1"),
        ("192.0.2.1", "[2001:db8:1::5]:443", "2001:db8:1::5"),
        ("192.0.2.1", "[2001:db8:1::5]", "2001:db8:1::5"),
        ("::ffff:192.0.2.1", "::ffff:198.51.100.1", "198.51.100.1"),
        # Nonsense where a trusted proxy should have written an address: that proxy stands for the
        # sender, and nothing left of it counts.
        ("192.0.2.1", "198.51.100.1, unknown", "192.0.2.1"),
        ("192.0.2.1", "198.51.100.1, garbage, 10.0.0.3", "10.0.0.3"),
        ("192.0.2.1", "198.51.100.1,", "192.0.2.1"),
        ("192.0.2.1", "999.1.1.1", "192.0.2.1"),
        ("192.0.2.1", "1.2.3.4:99999", "192.0.2.1"),
        ("192.0.2.1", "[::1", "192.0.2.1"),
        ("192.0.2.1", "[::1]junk", "192.0.2.1"),
        ("192.0.2.1", "\u00e9t\u00e9", "192.0.2.1"),
        ("192.0.2.1", "1.2.3.4:\u0661\u0662", "192.0.2.1"),  # digits, but not ASCII ones
        ("192.0.2.1", "1" * 4000, "192.0.2.1"),
    ],
)
def test_the_client_address(peer, header, client):
    assert _resolve(peer, header) == client


def test_with_no_trusted_proxies_the_header_never_counts():
    assert _resolve("127.0.0.1", "198.51.100.1", trusted=()) == "127.0.0.1"


def test_without_a_peer_address_there_is_none():
    assert _resolve(None, "198.51.100.1") is None
    assert _resolve("", "198.51.100.1") is None
    assert _resolve("unix-socket", "198.51.100.1") is None


def test_an_ipv6_zone_is_dropped():
    assert str(parse_address("fe80::1%eth0")) == "fe80::1"


def test_the_request_reader_uses_the_setting(settings):
    settings.TRUSTED_PROXIES = parse_networks("TRUSTED_PROXIES", "127.0.0.1")
    request = RequestFactory().get("/", REMOTE_ADDR="127.0.0.1", HTTP_X_FORWARDED_FOR="198.51.100.1")
    assert client_address(request) == "198.51.100.1"
    settings.TRUSTED_PROXIES = ()
    assert client_address(request) == "127.0.0.1"


def test_trusted_proxies_lists_addresses_and_networks():
    assert parse_networks("TRUSTED_PROXIES", "") == ()
    assert [str(n) for n in parse_networks("TRUSTED_PROXIES", " 10.0.0.5, ,172.16.0.0/12,::1 ")] == [
        "10.0.0.5/32",
        "172.16.0.0/12",
        "::1/128",
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("*", "'*' would trust every client"),
        ("10.0.0.1/8", "'10.0.0.1/8' is not one (10.0.0.1/8 has host bits set)"),
        ("proxy.internal", "'proxy.internal' is not one"),
        ("10.0.0.1, 10.0.0.300", "'10.0.0.300' is not one"),
    ],
)
def test_a_bad_trusted_proxies_value_names_the_setting_and_the_item(value, message):
    with pytest.raises(ImproperlyConfigured, match="TRUSTED_PROXIES") as error:
        parse_networks("TRUSTED_PROXIES", value)
    assert message in str(error.value)
