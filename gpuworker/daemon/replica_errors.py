"""What a failed replica's error says: the first line of its real cause first and whole, then what
happened to the process, then as much of its log's end as the heartbeat contract keeps.

A log tail alone cut the cause off (`[Errno 98] address already in use` sat above the last 1,500
characters); the cause is now read out of the log and put where no limit cuts it.
"""

from __future__ import annotations

import re

from gpuworker.contract.heartbeat import MAX_REPLICA_ERROR_CHARS

LOG_TAIL_HEADER = "; last log lines:\n"
TRACEBACK_START = "Traceback (most recent call last):"
# An ERROR or CRITICAL line of our log format ("<date> <time>,<ms> ERROR name: message", see
# gpuworker/__main__.py) or of uvicorn's ("ERROR:    message").
_LOG_ERROR = re.compile(r"^(?:\S+ \S+ (?:ERROR|CRITICAL) \S+: |(?:ERROR|CRITICAL):\s+)(?P<message>\S.*)$")


def error_cause(log_text: str) -> str:
    """The first line of the real error in a replica's log: the exception line of the last Python
    traceback (of a chain, the exception raised last), else the message of the last ERROR or
    CRITICAL log line; "" when there is neither (a process killed from outside writes nothing)."""
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == TRACEBACK_START]
    if starts:
        for line in lines[starts[-1] + 1 :]:
            # Frames, source lines and caret markers are indented; the exception line is not.
            if line.strip() and not line[0].isspace():
                return line.strip()
    for line in reversed(lines):
        if (match := _LOG_ERROR.match(line.strip())) is not None:
            return match["message"].strip()
    return ""


def failure_message(*, cause: str, what: str, log_text: str) -> str:
    """The first line of `cause` (say, `error_cause(log_text)`; "" for none) whole, then `what`
    happened to the process, then the end of `log_text` that still fits in the contract's limit."""
    first_line = cause.strip().splitlines()[0] if cause.strip() else ""
    head = (f"{first_line}\n{what}" if first_line else what)[:MAX_REPLICA_ERROR_CHARS]
    tail = log_text.strip()
    room = MAX_REPLICA_ERROR_CHARS - len(head) - len(LOG_TAIL_HEADER)
    if not tail or room <= 0:
        return head
    if len(tail) > room:
        tail = tail[-room:]
        tail = tail[tail.find("\n") + 1 :] if "\n" in tail else tail  # from a line's start
    return f"{head}{LOG_TAIL_HEADER}{tail}"
