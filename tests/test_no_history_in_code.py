"""Product code says why it is as it is now; its history (dates, work sessions, issue numbers, commit
hashes) belongs in git, BENCHMARKS.md and RELIABILITY.md. This reads every .py, .html and .json file
under gpuworker/ and controlplane/ (migrations aside: Django writes dates into them) and fails with
file:line for each line that carries such a reference.

The patterns are tight on purpose, so that the words' ordinary uses stay allowed:
- a date: an ISO calendar date (2026-12-02), not a version or a port;
- a work-history session: an ordinal before "session" ("the sixth session"), "session 12", or
  "earlier sessions" / "work periods"; a web session, a playground session and start_new_session
  are none of these;
- our issue or pull-request number: "issue 21", "issue #21", "PR 7" (an upstream tracker's is written
  owner/repo#N, which is allowed);
- a commit hash: a run of 7 to 40 lowercase hex digits holding both a digit and a letter, standing
  alone: not part of a longer word or hex run (a SHA-256 test vector is 64 digits), not after '#'
  (a colour), '0x' (a constant) or '-' and not before '-' (a UUID's groups), and not all digits (a
  number).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuworker", "controlplane")
SUFFIXES = {".py", ".html", ".json"}

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
    "|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\\d+(?:st|nd|rd|th)"
)
PATTERNS = {
    "date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    "work session": re.compile(
        rf"\b(?:{_ORDINALS})\s+(?:work\s+)?session\b|\bsession\s+#?\d+\b"
        r"|\b(?:earlier|previous|past|prior)\s+(?:work\s+)?sessions\b|\bwork\s+periods?\b",
        re.IGNORECASE,
    ),
    "issue number": re.compile(r"\b(?:issues?|PRs?|pull\s+requests?)(?:\s+#?|#)\d+\b", re.IGNORECASE),
    "commit hash": re.compile(r"(?<![\w#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w-])"),
}


def product_files() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*")
        if path.suffix in SUFFIXES and "migrations" not in path.parts and "__pycache__" not in path.parts
    )


def history_references(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for each line of `text` that carries a history reference."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def test_no_dates_sessions_issue_numbers_or_hashes_in_product_code():
    assert product_files(), "no product files found"
    found = [
        f"{path.relative_to(ROOT)}:{number}: {what}: {line}"
        for path in product_files()
        for number, what, line in history_references(path.read_text())
    ]
    assert not found, "history in product code (say why instead, or move it to BENCHMARKS.md):\n" + "\n".join(found)


def test_the_patterns_catch_history_and_leave_ordinary_words_alone():
    history = [
        "# bench/quant_gemm.py on the H200 (2026-12-02, BENCHMARKS.md)",
        "# BENCHMARKS.md, fifth session, the decode tile",
        "fourteenth session: x read as words",
        "# The kernel as it was before issue 21",
        "as they were in the spare for Issue #19",
        "# measured in earlier work periods",
        "commit 016a8d8; BENCHMARKS.md",
        "(934d452 worked around that race in a test)",
    ]
    for line in history:
        assert history_references(line), line
    ordinary = [
        'INSTALLED_APPS = ["django.contrib.sessions"]',
        "start_new_session=True, pass_fds=(listener.fileno(),)",
        "# A playground session renews its key before this runs out",
        "PHILOX_ROUND_A = 0xD2511F53",
        "INT_MAX: tl.constexpr = 2147483647",
        'color: "#1a2b3c4d";',
        "id = '123e4567-e89b-12d3-a456-426614174000'",
        "digest = 'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'",
        "# xgrammar (through 0.2.9, mlc-ai/xgrammar#800) writes",
        "# tearing down idle consumers (django/channels_redis#422)",
        "# the defaced facade",  # hex letters, no digit
        "python 3.11, port 5432, torch 2.9.1",
    ]
    for line in ordinary:
        assert not history_references(line), line
