"""Money on the dashboard's pages, always through `common.money.format_usd`:

- `{{ amount|usd }}`: balances, grants, totals, revenue, costs and margins, to the cent ("$25.00";
  a non-zero amount under half a cent keeps its digits, "$0.004", rather than read "$0.00");
- `{{ price|usd_price }}`: a per-request price or charge, up to six significant digits ("$0.002");
- `{{ charge|cost }}`: a served request's charge, or "included in plan" when the plan's monthly
  allowance paid for it, not "$0.00";
- `{{ amount|money_input }}`: an amount as a form field's value ("5", "0.25"), without a sign.
"""

from decimal import Decimal

from django import template

from controlplane.common.money import PRICE_SIGNIFICANT_DIGITS, format_usd

register = template.Library()

INCLUDED = "included in plan"


def _blank(value) -> bool:
    return value is None or value == ""


@register.filter
def usd(value) -> str:
    return "" if _blank(value) else format_usd(value)


@register.filter
def usd_price(value) -> str:
    return "" if _blank(value) else format_usd(value, significant=PRICE_SIGNIFICANT_DIGITS)


@register.filter
def cost(value) -> str:
    """A charge as money, or "included in plan" when nothing was charged for served traffic: use
    it for completed requests (failed ones are never charged, whatever the plan)."""
    if not _blank(value) and Decimal(str(value)) == 0:
        return INCLUDED
    return usd_price(value)


@register.filter
def money_input(value) -> str:
    if _blank(value):
        return ""
    text = f"{Decimal(str(value)):f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
