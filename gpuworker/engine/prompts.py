"""Prompts made ready for the engine: text tokenized (within the context), token ids checked, chat
conversations rendered by the model's template. Needs only the tokenizer and the configs, so an API
process tokenizes with it while the engine process steps (engine_process_client.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jinja2 import TemplateError

from gpuworker.engine.config import EngineConfig
from gpuworker.engine.scheduler import check_admissible

# A text longer than max_model_len times this many characters is first tokenized by its head only
# (no tokenizer we serve averages more characters per token on real text).
PREFIX_CHARS_PER_TOKEN = 16

Prompt = str | list[int]


class TokenizedPrompt(NamedTuple):
    """A prompt made ready by `LLMEngine.tokenize` (or `render_chat`): its text if it was text,
    and its checked token ids. A server makes it off the engine thread, which then only adds it."""

    text: str | None
    token_ids: list[int]


class PromptTokenizer:
    def __init__(self, tokenizer: Any, model_config: Any, config: EngineConfig) -> None:
        self.tokenizer, self.model_config, self.config = tokenizer, model_config, config

    def tokenize(self, prompt: Prompt, add_special_tokens: bool = True) -> TokenizedPrompt:
        """Text to token ids, or token ids checked against the vocabulary; ValueError for bad input.
        Safe to call from any thread: it only reads the tokenizer and the configs."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
            try:
                return TokenizedPrompt(prompt, self._encode(prompt, add_special_tokens))
            except TypeError as exc:  # text the tokenizer cannot read (e.g. a lone surrogate)
                raise ValueError(f"prompt: the tokenizer cannot read this text: {exc}") from None
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or list of token ids")
        vocab_size = self.model_config.vocab_size
        for token_id in prompt:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise ValueError(f"prompt: token id {token_id!r} is not in [0, {vocab_size})")
        return TokenizedPrompt(None, list(prompt))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow (pure Python) tokenizer
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        # What tokenizer.encode does, minus what stalls other threads: the batch call releases the
        # GIL while it works (the single-text call holds it for seconds on megabytes), and only the
        # ids become Python objects (not the mask and the rest transformers converts too).
        max_model_len = self.config.max_model_len
        head_chars = max_model_len * PREFIX_CHARS_PER_TOKEN
        if len(text) > head_chars:
            # A text far longer than the context is refused from its head: tokenizing megabytes only
            # to refuse them keeps a core busy for seconds that other streams need. The head's
            # tokens are the text's first ones, but for the one its cut may split.
            head = backend.encode_batch([text[:head_chars]], add_special_tokens=add_special_tokens)[0]
            if len(head) - 1 >= max_model_len:
                raise ValueError(
                    f"prompt has at least {len(head) - 1} tokens (in its first {head_chars} of "
                    f"{len(text)} characters), which leaves no room to generate within "
                    f"max_model_len ({max_model_len})"
                )
        encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if len(encoding) >= max_model_len:
            # Refused now, by its length alone: millions of ids as Python ints would hold the GIL
            # for a fifth of a second, only to be refused by the same check in add_request.
            check_admissible(self.config, len(encoding), None, 1)
        return encoding.ids

    def render_chat(
        self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> TokenizedPrompt:
        """One conversation through the model's chat template: its text and token ids.

        `tools` (OpenAI function tools) are handed to the template, which writes them into the
        prompt in the format the model was trained on."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model's tokenizer has no chat template")
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except (TemplateError, TypeError) as exc:  # a template's raise_exception(), or unreadable messages
            raise ValueError(f"messages: the model's chat template refused them: {exc}") from exc
        # The template writes its own special tokens (BOS): do not add them twice.
        return self.tokenize(text, add_special_tokens=False)
