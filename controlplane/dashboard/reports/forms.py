"""The report's range and grouping, from the query string (so a report is a link to share)."""

from datetime import date, timedelta

from django import forms
from django.utils import timezone

from controlplane.billing.reports import GROUPINGS

DEFAULT_DAYS = 30
MAX_DAYS = 366


class ReportForm(forms.Form):
    start = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="First day (UTC), included.")
    end = forms.DateField(widget=forms.DateInput(attrs={"type": "date"}), help_text="Last day (UTC), included.")
    group_by = forms.ChoiceField(choices=[(g, g.capitalize()) for g in GROUPINGS], initial="tenant",
                                 label="Group by")

    @classmethod
    def from_query(cls, query) -> "ReportForm":
        """Bound to the query string, with the defaults (the last 30 days by tenant) filled in."""
        today = timezone.now().date()
        data = {"start": (today - timedelta(days=DEFAULT_DAYS - 1)).isoformat(), "end": today.isoformat(),
                "group_by": "tenant"}
        data.update({name: query[name] for name in data if query.get(name)})
        return cls(data)

    def clean(self):
        data = super().clean()
        start, end = data.get("start"), data.get("end")
        if start and end:
            if start > end:
                self.add_error("end", "The last day must be on or after the first day.")
            elif (end - start).days + 1 > MAX_DAYS:
                self.add_error("end", f"A report covers at most {MAX_DAYS} days; "
                                      f"this range has {(end - start).days + 1}.")
        return data

    @property
    def period(self) -> tuple[date, date]:
        return self.cleaned_data["start"], self.cleaned_data["end"]
