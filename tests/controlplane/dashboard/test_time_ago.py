"""The `ago` template filter: "just now" under a minute (Django's timesince says "0 minutes")."""

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.dashboard.templatetags.time_ago import ago

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("before", "text"),
    [
        (timedelta(0), "just now"),
        (timedelta(seconds=59), "just now"),
        (timedelta(seconds=-30), "just now"),  # a clock a little ahead
        (timedelta(minutes=1), "1 minute ago"),
        (timedelta(hours=2, minutes=3), "2 hours, 3 minutes ago"),
        (timedelta(days=3), "3 days ago"),
    ],
)
def test_ago(before, text):
    # Django joins a figure and its unit with a no-break space, so "5 minutes" never wraps.
    assert ago(NOW - before, NOW).replace("\xa0", " ") == text


def test_no_moment_is_empty():
    assert ago(None) == ""
