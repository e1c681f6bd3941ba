"""Money: a Decimal in Python, a whole number of micro-units (millionths) in the database.

Every amount the control plane stores (prices, ledger entries, balances, holds, charges, spend
limits) is a `MoneyField`, an integer column of micro-units, so the database adds amounts up as
integers: exactly, on PostgreSQL and on SQLite alike (SQLite keeps a decimal column as a float,
and its SUM drifts). Python, forms, the admin and the API see Decimals with six decimal places.
`to_micros` and `from_micros` are the one conversion, used by the field and by billing's plain SQL.
"""

from decimal import ROUND_HALF_UP, Decimal

from django import forms
from django.core import validators
from django.core.exceptions import ValidationError
from django.db import models
from django.db.models.functions import Coalesce
from django.utils.functional import cached_property

DECIMAL_PLACES = 6
MAX_DIGITS = 18  # below a trillion: the micro-units fit a 64-bit integer with room to add
MONEY_DIGITS = {"max_digits": MAX_DIGITS, "decimal_places": DECIMAL_PLACES}  # for forms.DecimalField
MICRO = Decimal(1).scaleb(-DECIMAL_PLACES)  # the smallest amount of money stored
MICROS_PER_UNIT = 10**DECIMAL_PLACES


def to_micros(amount: Decimal | int) -> int:
    """`amount` as a whole number of micro-units; refuses floats (a float cannot hold cents
    exactly) and amounts finer than a micro-unit (nothing is rounded silently)."""
    if isinstance(amount, bool) or not isinstance(amount, Decimal | int):
        raise TypeError(f"Give money as a Decimal, not {type(amount).__name__} ({amount!r}).")
    micros = Decimal(amount).scaleb(DECIMAL_PLACES)
    if not micros.is_finite() or micros != micros.to_integral_value():
        raise ValueError(f"{amount} is not a whole number of millionths.")
    return int(micros)


def from_micros(micros: int | Decimal) -> Decimal:
    """A number of micro-units (an integer; PostgreSQL returns SUM of integers as a whole Decimal)
    as an amount with six decimal places: 2000 -> Decimal("0.002000")."""
    if isinstance(micros, bool) or not isinstance(micros, int | Decimal) or micros != int(micros):
        raise TypeError(f"Expected a whole number of micro-units, got {micros!r}.")
    return Decimal(int(micros)).scaleb(-DECIMAL_PLACES)


class MoneyField(models.BigIntegerField):
    """An amount of money: a Decimal on the model, micro-units in a 64-bit integer column. Sums
    over it (`Sum("amount")`) come back as exact Decimals too."""

    description = "Money (stored as micro-units)"
    default_validators = [validators.DecimalValidator(MAX_DIGITS, DECIMAL_PLACES)]
    default_error_messages = {"invalid": "“%(value)s” is not an amount of money (a decimal number)."}

    @cached_property
    def validators(self):
        # The decimal validator above bounds the amount; the integer range checks BigIntegerField
        # would add compare it, a Decimal, with limits meant for the stored micro-units.
        return [*self.default_validators, *self._validators]

    def to_python(self, value):
        if value is None or isinstance(value, Decimal):
            return value
        if isinstance(value, float | bool):
            raise ValidationError(f"Give money as a Decimal, not {type(value).__name__}.", code="invalid")
        try:
            amount = Decimal(value if isinstance(value, int) else str(value).strip())
        except ArithmeticError:
            raise ValidationError(self.error_messages["invalid"], code="invalid", params={"value": value}) from None
        if not amount.is_finite():
            raise ValidationError(self.error_messages["invalid"], code="invalid", params={"value": value})
        return amount

    def get_prep_value(self, value):
        value = models.Field.get_prep_value(self, value)
        if value is None:
            return None
        amount = self.to_python(value)
        try:
            return to_micros(amount)
        except ValueError as error:
            raise ValueError(f"Field '{self.name}': {error}") from None

    def from_db_value(self, value, expression, connection):
        return None if value is None else from_micros(value)

    def formfield(self, **kwargs):
        return models.Field.formfield(self, **{"form_class": forms.DecimalField, **MONEY_DIGITS, **kwargs})


CENT = Decimal("0.01")
PRICE_SIGNIFICANT_DIGITS = 6


def format_usd(amount: Decimal | int | str, *, significant: int | None = None) -> str:
    """The one way money is written for people: "$1,234.50", "-$3.00".

    Amounts are rounded to the cent (half up), except a per-request price or charge, which keeps
    `significant` digits ("$0.002", "$1.23457") and at least the cents. A non-zero amount that the
    cents would show as "$0.00" keeps its significant digits too ("$0.004"), so nothing spent or
    earned reads as nothing.
    """
    value = Decimal(str(amount))
    digits = significant
    if digits is None and value != 0 and abs(value) < CENT / 2:
        digits = PRICE_SIGNIFICANT_DIGITS
    exponent = -2 if digits is None or value == 0 else min(value.adjusted() - digits + 1, -2)
    rounded = abs(value).quantize(Decimal(1).scaleb(exponent), rounding=ROUND_HALF_UP)
    whole, _, fraction = f"{rounded:,f}".partition(".")
    fraction = fraction.rstrip("0").ljust(2, "0")
    return f"{'-' if value < 0 and rounded != 0 else ''}${whole}.{fraction}"


def money_sum(expression, **options) -> Coalesce:
    """`Sum(expression)` as money, 0 when there is nothing to add up: an exact Decimal everywhere."""
    return Coalesce(models.Sum(expression, **options), models.Value(0), output_field=MoneyField())
