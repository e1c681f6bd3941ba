"""Incremental JSON string decoding: whatever the cuts in the text, the pieces add up to what
json.loads decodes, and nothing but an incomplete escape is held back."""

from __future__ import annotations

import json

import pytest

from gpuworker.replica.json_string import REPLACEMENT, JsonStringDecoder

BODIES = [
    r"plain text",
    r"a \"quote\", a \\ backslash, a \/ slash",
    r"\b\f\n\r\t controls",
    r"\u00e9t\u00E9 \u20ac",
    r"emoji \ud83d\ude00 and \uD83C\uDDEB\uD83C\uDDF7 flags",
    r"\\u005c is not an escape here",
    r"",
]


def _decode_in_pieces(body: str, cuts: list[int]) -> tuple[str, JsonStringDecoder]:
    decoder = JsonStringDecoder()
    text = body + '"'
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return "".join(decoder.feed(piece) for piece in pieces) + decoder.finish(), decoder


@pytest.mark.parametrize("body", BODIES)
def test_every_cut_decodes_as_json_does(body):
    expected = json.loads(f'"{body}"')
    for cut in range(len(body) + 2):
        decoded, decoder = _decode_in_pieces(body, [cut])
        assert decoded == expected, cut
        assert decoder.closed
    # One character at a time, too.
    decoded, _ = _decode_in_pieces(body, list(range(1, len(body) + 1)))
    assert decoded == expected


@pytest.mark.parametrize(
    "pieces, said",
    [
        (["ab\\", "n"], ["ab", "\n"]),  # a backslash waits for what it escapes
        (["\\u00", "e9x"], ["", "éx"]),  # \uXXXX waits for its four digits
        (["\\ud83d", "\\ude00"], ["", "😀"]),  # a high surrogate waits for its low half
        (["x\\ud83d\\", "u", "de00"], ["x", "", "😀"]),  # ...cut anywhere in it
        (["\\ud83d", "x"], ["", REPLACEMENT + "x"]),  # a lone high surrogate
        (["\\ude00y"], [REPLACEMENT + "y"]),  # a lone low surrogate
    ],
)
def test_only_an_incomplete_escape_is_held_back(pieces, said):
    decoder = JsonStringDecoder()
    assert [decoder.feed(piece) for piece in pieces] == said
    assert not decoder.closed


def test_the_closing_quote_ends_the_string_and_keeps_the_rest():
    decoder = JsonStringDecoder()
    assert decoder.feed('one \\"two\\"') == 'one "two"'
    assert decoder.feed('" }') == ""
    assert decoder.closed and decoder.rest == " }"
    assert decoder.feed("\n}") == "" and decoder.rest == " }\n}"


@pytest.mark.parametrize(
    "cut_text, tail", [("abc\\", ""), ("abc\\u12", ""), ("abc\\ud83d", REPLACEMENT), ("abc\\ud83d\\ud", REPLACEMENT)]
)
def test_text_that_ends_inside_an_escape(cut_text, tail):
    decoder = JsonStringDecoder()
    assert decoder.feed(cut_text) == "abc"
    assert decoder.finish() == tail
