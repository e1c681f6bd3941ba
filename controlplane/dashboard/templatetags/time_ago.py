"""`{{ moment|ago }}`: how long ago, for people ("just now", "5 minutes ago", "2 days, 3 hours ago")."""

from datetime import datetime, timedelta

from django import template
from django.utils import timezone
from django.utils.timesince import timesince

register = template.Library()


@register.filter
def ago(moment: datetime | None, now: datetime | None = None) -> str:
    if moment is None:
        return ""
    now = now or timezone.now()
    # Django's timesince says "0 minutes" for anything under a minute (and for a moment ahead).
    if now - moment < timedelta(minutes=1):
        return "just now"
    return f"{timesince(moment, now)} ago"
