"""Helpers for the apps' services."""

from typing import TypeVar

from django.db.models import Model

M = TypeVar("M", bound=Model)


def validated_save(instance: M) -> M:
    """Save `instance` after `full_clean()`, so bad input is refused with a ValidationError naming
    the field (not a database error, and nothing written)."""
    instance.full_clean()
    instance.save()
    return instance
