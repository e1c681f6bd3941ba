"""Incremental detokenization and the stop conditions of one sequence.

Text streams out in valid UTF-8 only: a token that ends in the middle of a multi-byte character
decodes to U+FFFD, so it is held back until the character completes. Stop strings are matched on
the decoded text, so they are found even when split across tokens, and text that could still turn
out to be the start of a stop string is held back until that is resolved: the stop text never leaks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

from gpuworker.engine.sampling_params import SamplingParams

# Prompt tokens decoded before the first new token, so word-initial spaces come out right.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def token_decoder(tokenizer: Any) -> Callable[..., str]:
    """tokenizer.decode without its conversion of the ids (to_py_obj walks every id of every call
    to check it is an int): a Hugging Face tokenizer's _decode, which decode calls after that, with
    the same special-token and clean-up rules. Two decodes per token per stream made decode's
    conversion a fifth of the engine loop's time at 512 streams (BENCHMARKS.md)."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer._decode
    return tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, num_prompt_tokens: int, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._decode = token_decoder(tokenizer) if tokenizer is not None else None
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        # token_ids[prefix_offset:read_offset] is the context already turned into text; decoding
        # from prefix_offset onwards and dropping that context's text yields the new text.
        self.prefix_offset = max(num_prompt_tokens - _CONTEXT_TOKENS, 0)
        self.read_offset = num_prompt_tokens
        # All output text decoded so far, including what is still held back.
        self.text = ""
        # How much of self.text has been released to the caller.
        self.num_released = 0

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Decode what token_ids (the whole sequence) adds; return the stop string it completed
        (the text is then cut there). check_stop=False (before min_tokens) skips the search."""
        previous_len = len(self.text)
        self.text += self._decode_new(token_ids, final=False)
        return self._find_stop(previous_len) if check_stop else None

    def finish(self, token_ids: list[int]) -> None:
        """Decode whatever is still pending (an incomplete character becomes U+FFFD)."""
        self.text += self._decode_new(token_ids, final=True)

    def release(self, final: bool) -> str:
        """The text that is safe to stream now (everything, when the sequence is finished)."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        if end <= self.num_released:
            return ""
        delta = self.text[self.num_released : end]
        self.num_released = end
        return delta

    @property
    def released_text(self) -> str:
        return self.text[: self.num_released]

    def _decode_new(self, token_ids: list[int], final: bool) -> str:
        if self.tokenizer is None or len(token_ids) <= self.read_offset:
            return ""
        decode = self._decode
        context = decode(token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        text = decode(token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if not final and (len(text) <= len(context) or text.endswith(_REPLACEMENT_CHAR)):
            return ""  # nothing yet, or a character still incomplete
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        return text[len(context) :]

    def _find_stop(self, previous_len: int) -> str | None:
        if not self.stop:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # Only a match that includes new text can be new.
            index = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + (len(stop) if self.include_stop_str_in_output else 0)]
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could begin a stop string."""
        longest = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def check_stop_token(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: list[int], max_tokens: int
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) if the just-sampled token ends the sequence, else None."""
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
    if num_output_tokens >= max_tokens:
        return "length", None
    return None
