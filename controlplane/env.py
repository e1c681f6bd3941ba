"""Typed readers for environment variables, so a bad value fails at start-up naming the variable."""

import ipaddress
import math
import os
from decimal import Decimal, InvalidOperation

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be one of 1/0, true/false, yes/no, on/off; got {raw!r}.")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer; got {raw!r}.") from None


def env_float(name: str, default: float) -> float:
    """A finite number of 0 or more, e.g. seconds."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number such as 0.5; got {raw!r}.") from None
    if not math.isfinite(value) or value < 0:
        raise ImproperlyConfigured(f"{name} must be a number of 0 or more; got {raw!r}.")
    return value


def env_decimal(name: str, default: str) -> Decimal:
    """A non-negative decimal amount, e.g. a price in dollars."""
    raw = os.environ.get(name)
    text = default if raw is None or raw.strip() == "" else raw.strip()
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ImproperlyConfigured(f"{name} must be a decimal number such as 2.50; got {raw!r}.") from None
    if not value.is_finite() or value < 0:
        raise ImproperlyConfigured(f"{name} must be a number of 0 or more; got {raw!r}.")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    """A comma-separated list; blank items are dropped."""
    raw = os.environ.get(name)
    if raw is None:
        return list(default)
    return [item.strip() for item in raw.split(",") if item.strip()]


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(name: str, text: str) -> tuple[IPNetwork, ...]:
    """Comma-separated addresses and networks (CIDR) such as `10.0.0.5, 172.16.238.0/24, ::1`."""
    networks = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item == "*":
            raise ImproperlyConfigured(
                f"{name} lists addresses or networks; '*' would trust every client to "
                "name its own address. List the proxies (0.0.0.0/0 if you truly mean all)."
            )
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"{name} must list IP addresses or networks such as 10.0.0.0/8; {item!r} is not one ({exc})."
            ) from None
    return tuple(networks)


def env_networks(name: str) -> tuple[IPNetwork, ...]:
    """parse_networks of the variable; unset or empty: none."""
    return parse_networks(name, os.environ.get(name, ""))


def read_env_file(path) -> dict[str, str]:
    """NAME=value lines of a dotenv-style file (comments and blank lines skipped); {} if missing."""
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        lines = [line.strip() for line in handle]
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}
