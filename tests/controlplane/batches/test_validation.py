"""Every line of a batch input file checked up front, by the gateway's request rules."""

import json

import pytest

from controlplane.batches.validation import check_lines, requests_of


def _line(custom_id="a", url="/v1/chat/completions", method="POST", **body) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body}).encode()


def test_good_lines_are_kept_with_their_numbers_and_blank_lines_skipped():
    raw = [_line("a"), b"\n", _line("b")]
    checked = check_lines(raw, endpoint="/v1/chat/completions")
    assert (checked.errors, checked.count, checked.model) == ([], 2, "m")
    assert [(n, c, body["model"]) for n, c, body in requests_of(raw)] == [(1, "a", "m"), (3, "b", "m")]


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{oops", None, "invalid_json"),
        (b"[1]", None, "invalid_json"),
        (_line(custom_id=""), "custom_id", "invalid_request"),
        (_line(url="/v1/embeddings"), "url", "mismatched_url"),
        (_line(method="GET"), "method", "invalid_request"),
        (_line(stream=True), "body.stream", "invalid_request"),
        (_line(temperature="hot"), "body.temperature", None),
        (_line(model="other"), "body.model", "invalid_request"),
    ],
)
def test_a_bad_line_is_named_with_its_field(raw, param, code):
    checked = check_lines([_line("first"), raw], endpoint="/v1/chat/completions")
    (error,) = checked.errors
    assert error["line"] == 2 and error["param"] == param
    if code is not None:
        assert error["code"] == code


def test_a_repeated_custom_id_and_an_empty_file_fail():
    (error,) = check_lines([_line("a"), _line("a")], endpoint="/v1/chat/completions").errors
    assert error["code"] == "duplicate_custom_id" and error["line"] == 2
    assert check_lines([b"\n"], endpoint="/v1/chat/completions").errors[0]["code"] == "empty_file"
