"""Incremental detokenization and stop conditions, on the byte-level test tokenizer (token i < 256
is byte i, so multi-byte characters and stop strings always span several tokens)."""

from __future__ import annotations

import pytest

from gpuworker.engine.detokenizer import IncrementalDetokenizer, check_stop_token
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.models.loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("llama"))


def stream(tokenizer, output: str | list[int], prompt: str = "Say:", **params):
    """Feed the output one token at a time as the engine does; return (deltas, stop string)."""
    detokenizer = IncrementalDetokenizer(tokenizer, len(prompt.encode()), SamplingParams(**params))
    token_ids = list(prompt.encode())
    deltas = []
    for token_id in list(output.encode()) if isinstance(output, str) else output:
        token_ids.append(token_id)
        stop = detokenizer.add_tokens(token_ids)
        if stop is not None:
            deltas.append(detokenizer.release(final=True))
            return deltas, stop
        deltas.append(detokenizer.release(final=False))
    detokenizer.finish(token_ids)
    deltas.append(detokenizer.release(final=True))
    return deltas, None


def test_multibyte_characters_stream_only_when_complete(tokenizer):
    text = "héllo wörld 你好 🎉!"
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)
    # The 4 bytes of the emoji give nothing, nothing, nothing, then the whole character.
    emoji = text.index("🎉")
    offset = len(text[:emoji].encode())
    assert deltas[offset : offset + 4] == ["", "", "", "🎉"]


def test_text_after_the_prompt_keeps_its_leading_space(tokenizer):
    deltas, _ = stream(tokenizer, " there", prompt="Hi")
    assert "".join(deltas) == " there"


def test_stop_string_across_tokens_is_cut_and_never_leaked(tokenizer):
    deltas, stop = stream(tokenizer, "abc STOP def", stop=["STOP"])
    assert stop == "STOP"
    assert "".join(deltas) == "abc "


def test_stop_string_can_be_kept_in_the_output(tokenizer):
    deltas, stop = stream(tokenizer, "abc STOP def", stop="STOP", include_stop_str_in_output=True)
    assert (stop, "".join(deltas)) == ("STOP", "abc STOP")


def test_possible_stop_prefix_is_held_back_until_resolved(tokenizer):
    deltas, stop = stream(tokenizer, "a ST b", stop=["STOP"])
    assert stop is None
    assert deltas == ["a", " ", "", "", "ST ", "b", ""]


def test_earliest_stop_string_wins(tokenizer):
    deltas, stop = stream(tokenizer, "xx END yy STOP", stop=["STOP", "END", "yy"])
    assert (stop, "".join(deltas)) == ("END", "xx ")


def test_stop_string_inside_a_multibyte_character_sequence(tokenizer):
    deltas, stop = stream(tokenizer, "un café! encore", stop=["é!"])
    assert (stop, "".join(deltas)) == ("é!", "un caf")


def test_incomplete_character_at_the_end_is_flushed(tokenizer):
    deltas, _ = stream(tokenizer, list("ok".encode()) + [0xE4, 0xBD])
    assert deltas[-1] == "\ufffd" and "".join(deltas) == "ok\ufffd"


def test_special_tokens_are_skipped_unless_asked(tokenizer):
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert "".join(stream(tokenizer, [ord("a"), eot, ord("b")])[0]) == "ab"
    kept, _ = stream(tokenizer, [ord("a"), eot, ord("b")], skip_special_tokens=False)
    assert "".join(kept) == "a<|eot_id|>b"


@pytest.mark.parametrize(
    "token, outputs, params, expected",
    [
        (9, 3, SamplingParams(), ("stop", None)),  # EOS
        (9, 3, SamplingParams(ignore_eos=True), None),
        (9, 3, SamplingParams(ignore_eos=True, max_tokens=3), ("length", None)),
        (5, 3, SamplingParams(stop_token_ids=[5]), ("stop", 5)),
        (5, 2, SamplingParams(stop_token_ids=[5], min_tokens=3), None),
        (1, 10, SamplingParams(), ("length", None)),
        (1, 9, SamplingParams(), None),
    ],
)
def test_check_stop_token(token, outputs, params, expected):
    assert check_stop_token(token, outputs, params, [9], max_tokens=params.max_tokens or 10) == expected


def test_decoding_skips_decode_s_id_conversion_and_keeps_its_text(tokenizer, monkeypatch):
    # decode converts every id of every call (to_py_obj) before _decode: at 512 streams, two
    # decodes a token, that was a fifth of the engine loop. The text must stay decode's, clean-up
    # of tokenization spaces (where the tokenizer applies it) and special tokens included.
    text = "Hello , world . It 's fine !"
    output_ids = list(text.encode()) + [tokenizer.eos_token_id]
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    expected = tokenizer.decode(list(b"Say:") + output_ids, skip_special_tokens=True)[len("Say:") :]

    def no_conversion(*args, **kwargs):
        raise AssertionError("decode called: each call walks its ids")

    monkeypatch.setattr(tokenizer, "decode", no_conversion)
    deltas, _ = stream(tokenizer, output_ids)
    assert "".join(deltas) == expected
