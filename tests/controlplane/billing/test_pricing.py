"""Pricing rules: the flat price per request and the per-token reference price, one rounding rule."""

from decimal import Decimal

import pytest

from controlplane.billing.pricing import flat_price, reference_price


def test_flat_price_is_per_request_less_those_the_allowance_pays_for():
    assert flat_price(price_per_request=Decimal("0.002"), num_requests=3) == Decimal("0.006")
    assert flat_price(price_per_request=Decimal("0.002"), num_requests=3, included=2) == Decimal("0.002")
    assert flat_price(price_per_request=Decimal("0.002"), num_requests=2, included=2) == Decimal("0")


def test_reference_price_rounds_to_micro_units():
    assert reference_price(per_million_tokens=Decimal("3"), tokens=1) == Decimal("0.000003")
    assert reference_price(per_million_tokens=Decimal("3"), tokens=0) == Decimal("0")
    assert reference_price(per_million_tokens=Decimal("3"), tokens=333_333) == Decimal("0.999999")
    assert reference_price(per_million_tokens=Decimal("0.30"), tokens=7) == Decimal("0.000002")  # 2.1 micro


@pytest.mark.parametrize(
    ("tokens", "price"),
    [
        (1, "0.000000"),  # 0.5 micro: down to the even 0 (half-up would give 0.000001)
        (3, "0.000002"),  # 1.5 micro: up to the even 2 (half-down or truncation would give 0.000001)
        (5, "0.000002"),  # 2.5 micro: down to 2
        (7, "0.000004"),  # 3.5 micro: up to 4
    ],
)
def test_reference_price_ties_round_half_even(tokens, price):
    assert reference_price(per_million_tokens=Decimal("0.50"), tokens=tokens) == Decimal(price)
