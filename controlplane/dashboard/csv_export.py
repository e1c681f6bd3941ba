"""What the dashboard's CSV exports share: text from tenants made inert for spreadsheets."""

# A spreadsheet runs a cell starting with one of these as a formula (=HYPERLINK(...) sends data
# out); OWASP's CSV injection advice: start such text with a ' so it stays text.
CSV_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """Text from tenants (a tenant, key or model name) made inert for spreadsheets; figures stay numbers."""
    return f"'{value}" if value.startswith(CSV_FORMULA_STARTS) else value
