"""Helpers for the billing statements written as plain SQL (credit holds and the credit-account
lock), for PostgreSQL and SQLite alike: placeholders, multi-row inserts, and values as each
backend stores and returns them."""

from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal

from django.db import connection

from controlplane.billing.models import MICRO


def insert(table: str, fields: Sequence[str], values: list[list], returning: str = "") -> list[tuple]:
    """One INSERT of all `values` rows; the `returning` columns of each row if asked for."""
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(fields)) + ")"] * len(values))
    sql = f"INSERT INTO {table} ({', '.join(fields)}) VALUES {placeholders}"
    params = [value for row in values for value in row]
    return rows(f"{sql} RETURNING {returning}", params) if returning else rows(sql, params, fetch=False)


def rows(sql: str, params, fetch: bool = True) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall() if fetch else []


def marks(items) -> str:
    return ", ".join(["%s"] * len(items))


def adapt(value):
    # What the database driver expects: aware datetimes and dates as the backend stores them.
    if isinstance(value, datetime):
        return connection.ops.adapt_datetimefield_value(value)
    if isinstance(value, date):
        return connection.ops.adapt_datefield_value(value)
    return value


def money(value) -> Decimal:
    # PostgreSQL returns NUMERIC as Decimal; SQLite (the embedded demo) as a number.
    return value if isinstance(value, Decimal) else Decimal(str(value)).quantize(MICRO)


def as_date(value) -> date | None:
    return date.fromisoformat(value) if isinstance(value, str) else value
