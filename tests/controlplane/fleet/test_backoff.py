from datetime import UTC, datetime, timedelta

import pytest

from controlplane.fleet.backoff import error_cause, next_attempt_at, retry_delay_seconds


def test_the_delay_doubles_from_the_initial_one_up_to_the_cap():
    delays = [retry_delay_seconds(consecutive_failures=n, initial_seconds=10, max_seconds=300) for n in range(1, 9)]
    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]


def test_no_failure_no_delay_and_a_long_outage_stays_capped():
    assert retry_delay_seconds(consecutive_failures=0, initial_seconds=10, max_seconds=300) == 0
    assert retry_delay_seconds(consecutive_failures=10_000, initial_seconds=10, max_seconds=300) == 300


def test_the_next_attempt_is_the_delay_after_the_failure():
    failed = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert next_attempt_at(
        failed_at=failed, consecutive_failures=3, initial_seconds=10, max_seconds=300
    ) == failed + timedelta(seconds=40)


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (
            "OSError: [Errno 98] address already in use\nTraceback (most recent call last):\n  ...",
            "OSError: [Errno 98] address already in use",
        ),
        ("\n\n  model path /x does not exist  \n", "model path /x does not exist"),
        ("", ""),
    ],
)
def test_the_cause_is_the_first_line_in_full(error, cause):
    assert error_cause(error) == cause
