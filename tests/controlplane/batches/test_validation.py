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


def _image_line(custom_id: str, *urls: str, model: str = "m") -> bytes:
    parts = [{"type": "text", "text": "what is it"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return _line(custom_id, model=model, messages=[{"role": "user", "content": parts}])


SMALL_PNG = "data:image/png;base64," + "A" * 400  # 300 bytes once decoded
LARGE_PNG = "data:image/png;base64," + "A" * 4000  # 3000 bytes


def test_image_lines_are_checked_by_the_models_image_rules():
    from gpuworker.contract.openai_api import ImageRules

    vision = ImageRules(model_name="m", takes_images=True, max_images=2, max_image_bytes=1000)
    asked = []

    def rules_for(name):
        asked.append(name)
        return vision

    raw = [
        _image_line("ok", SMALL_PNG, SMALL_PNG),
        _line("text"),
        _image_line("many", SMALL_PNG, SMALL_PNG, SMALL_PNG),
        _image_line("large", SMALL_PNG, LARGE_PNG),
    ]
    checked = check_lines(raw, endpoint="/v1/chat/completions", image_rules_for=rules_for)
    assert asked == ["m"]  # once per file
    assert [(e["line"], e["param"], e["code"]) for e in checked.errors] == [
        (3, "body.messages.0.content.3.image_url", "too_many_images"),
        (4, "body.messages.0.content.2.image_url", "invalid_image"),
    ]
    assert "at most 2" in checked.errors[0]["message"] and "1000 bytes" in checked.errors[1]["message"]
    text_only = ImageRules(model_name="m", takes_images=False, max_images=16, max_image_bytes=1 << 20)
    (error,) = check_lines(
        [_line("text"), _image_line("img", SMALL_PNG)],
        endpoint="/v1/chat/completions",
        image_rules_for=lambda name: text_only,
    ).errors
    assert (error["line"], error["param"], error["code"]) == (2, "body.model", "model_not_multimodal")
    assert "'m' is a text-only model" in error["message"]
    # A model the catalog does not know: its lines fail when sent, as other lines of it do.
    unknown = check_lines(
        [_image_line("img", SMALL_PNG)], endpoint="/v1/chat/completions", image_rules_for=lambda name: None
    )
    assert (unknown.errors, unknown.count) == ([], 1)
