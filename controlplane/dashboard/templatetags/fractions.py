"""Fractions on the dashboard's pages: `{{ 0.0463|signed_percent }}` reads "+4.63%"."""

from django import template

register = template.Library()


@register.filter
def signed_percent(value) -> str:
    if value is None or value == "":
        return ""
    return f"{float(value):+.2%}"
