"""What the dashboard's CSV exports share: text from tenants made inert for spreadsheets, and
amounts of money written alike."""

from decimal import ROUND_HALF_EVEN, Decimal

from controlplane.common.money import MICRO

# A spreadsheet runs a cell starting with one of these as a formula (=HYPERLINK(...) sends data
# out); OWASP's CSV injection advice: start such text with a ' so it stays text.
CSV_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """Text from tenants (a tenant, key or model name) made inert for spreadsheets; figures stay numbers."""
    return f"'{value}" if value.startswith(CSV_FORMULA_STARTS) else value


def csv_money(amount) -> str:
    """An amount with the ledger's six decimal places ("0.000000" for nothing), so a column reads
    alike whatever arithmetic made the figure."""
    return str(Decimal(amount).quantize(MICRO, rounding=ROUND_HALF_EVEN))
