"""Ranges of days from the query string (so a report or a log view is a link to share): the
admin report's range and grouping, and the period form the other pages that read usage share."""

from datetime import date, timedelta

from django import forms
from django.utils import timezone

from controlplane.billing.reports import GROUPINGS

DEFAULT_DAYS = 30
MAX_DAYS = 366


class PeriodForm(forms.Form):
    """A range of whole days (UTC), both included, at most MAX_DAYS long."""

    start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="First day (UTC), included.")
    end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="Last day (UTC), included.")

    @classmethod
    def from_query(cls, query, **defaults):
        """Bound to the query string, with the defaults filled in (see query_data)."""
        return cls(cls.query_data(query, **defaults))

    @classmethod
    def query_data(cls, query, *, start: date | None = None, **defaults: str) -> dict:
        """The query string's values of this form's fields, the defaults where it has none: from
        `start` (the last DEFAULT_DAYS days when None) to today, and `defaults` for the others."""
        today = timezone.now().date()
        start = start or today - timedelta(days=DEFAULT_DAYS - 1)
        data = {"start": start.isoformat(), "end": today.isoformat(), **defaults}
        data.update({name: query[name] for name in cls.base_fields if query.get(name)})
        return data

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end:
            if start > end:
                self.add_error("end", "The last day must be on or after the first day.")
            elif (end - start).days + 1 > MAX_DAYS:
                self.add_error(
                    "end", f"A report covers at most {MAX_DAYS} days; this range has {(end - start).days + 1}."
                )
        return data

    @property
    def period(self) -> tuple[date, date]:
        return self.cleaned_data["start"], self.cleaned_data["end"]


class ReportForm(PeriodForm):
    group_by = forms.ChoiceField(choices=[(g, g.capitalize()) for g in GROUPINGS], initial="tenant", label="Group by")

    @classmethod
    def from_query(cls, query, **defaults) -> "ReportForm":
        """The last 30 days by tenant unless the query string says otherwise."""
        return super().from_query(query, **{"group_by": "tenant", **defaults})
