"""Helpers for the billing statements written as plain SQL (credit holds and the credit-account
lock), for PostgreSQL and SQLite alike: placeholders, multi-row inserts, and values as each
backend stores and returns them. Money travels as micro-units (`common.money`) both ways: every
parameter passes `adapt`, and every amount read back passes `from_micros`."""

from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal

from django.db import connection

from controlplane.common.money import to_micros


def insert(table: str, fields: Sequence[str], values: list[list], returning: str = "") -> list[tuple]:
    """One INSERT of all `values` rows; the `returning` columns of each row if asked for."""
    placeholders = ", ".join(["(" + ", ".join(["%s"] * len(fields)) + ")"] * len(values))
    sql = f"INSERT INTO {table} ({', '.join(fields)}) VALUES {placeholders}"
    params = [value for row in values for value in row]
    return rows(f"{sql} RETURNING {returning}", params) if returning else rows(sql, params, fetch=False)


def rows(sql: str, params, fetch: bool = True) -> list[tuple]:
    with connection.cursor() as cursor:
        cursor.execute(sql, adapt_all(params))
        return cursor.fetchall() if fetch else []


def marks(items) -> str:
    return ", ".join(["%s"] * len(items))


def adapt(value):
    """A parameter as the column stores it: money (every Decimal in these statements is money) as
    micro-units, aware datetimes and dates as the backend stores them."""
    if isinstance(value, Decimal):
        return to_micros(value)
    if isinstance(value, datetime):
        return connection.ops.adapt_datetimefield_value(value)
    if isinstance(value, date):
        return connection.ops.adapt_datefield_value(value)
    return value


def adapt_all(params: Sequence | dict) -> list | dict:
    if isinstance(params, dict):
        return {name: adapt(value) for name, value in params.items()}
    return [adapt(value) for value in params]


def as_date(value) -> date | None:
    return date.fromisoformat(value) if isinstance(value, str) else value
