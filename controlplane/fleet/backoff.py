"""Retrying failed loads: the capped exponential schedule and the cause line of an error, as pure
functions (no ORM) that the fleet's services and selectors share."""

from datetime import datetime, timedelta


def retry_delay_seconds(*, consecutive_failures: int, initial_seconds: float, max_seconds: float) -> float:
    """How long to leave a (deployment, worker) after its `consecutive_failures`-th failed load in
    a row: `initial_seconds`, doubling with each further failure, never more than `max_seconds`."""
    if consecutive_failures < 1:
        return 0.0
    # The exponent is capped too, so a long outage cannot overflow the float.
    return float(min(max_seconds, initial_seconds * 2 ** min(consecutive_failures - 1, 62)))


def next_attempt_at(
    *, failed_at: datetime, consecutive_failures: int, initial_seconds: float, max_seconds: float
) -> datetime:
    return failed_at + timedelta(
        seconds=retry_delay_seconds(
            consecutive_failures=consecutive_failures, initial_seconds=initial_seconds, max_seconds=max_seconds
        )
    )


def error_cause(error: str) -> str:
    """The first non-blank line of an error, in full: the worker puts the cause there (a traceback
    or log excerpt may follow)."""
    for line in error.splitlines():
        if line.strip():
            return line.strip()
    return ""
