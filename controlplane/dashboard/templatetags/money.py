"""Money on the dashboard's pages: `{{ amount|usd }}` reads "$25.00" or "$0.002" (the ledger keeps
millionths; trailing zeros beyond the cents are dropped), and `{{ amount|cost }}` says "included
in plan" for a served request or day that the plan's monthly allowance paid for, not "$0.00"."""

from decimal import Decimal

from django import template

register = template.Library()

INCLUDED = "included in plan"


@register.filter
def usd(value) -> str:
    if value is None or value == "":
        return ""
    amount = Decimal(str(value))
    whole, _, fraction = f"{abs(amount):,.6f}".partition(".")
    fraction = fraction.rstrip("0").ljust(2, "0")
    return f"{'-' if amount < 0 else ''}${whole}.{fraction}"


@register.filter
def cost(value) -> str:
    """A charge as money, or "included in plan" when nothing was charged for served traffic: use
    it for completed requests (failed ones are never charged, whatever the plan)."""
    if value is not None and value != "" and Decimal(str(value)) == 0:
        return INCLUDED
    return usd(value)
