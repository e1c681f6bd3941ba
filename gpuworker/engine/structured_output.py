"""Constrained decoding with xgrammar: what a request asks for, and its compiled grammars.

`StructuredOutput` (no torch, no xgrammar) is what SamplingParams carries. `GrammarCache` compiles
it once per distinct (kind, spec) against the model's tokenizer, LRU-bounded. The engine's
per-sequence matchers and per-step token masks are in `grammar_masks`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)

StructuredOutputKind = Literal["json_object", "json_schema", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = ("json_object", "json_schema", "ebnf", "structural_tag")
# Distinct compiled grammars kept; one compiled JSON schema is typically tens of KB to a few MB.
DEFAULT_GRAMMAR_CACHE_SIZE = 256
# The longest run of whitespace any JSON grammar (json_object, json_schema, the arguments of a
# forced tool call) allows between two tokens of the JSON: one blank, as in `{"a": 1, "b": 2}`.
# Longer runs let a weak or random model spend its whole token budget on blanks (at 32, a random
# model wrote 30-blank runs and ran out of tokens); newlines and indentation are never needed.
# 1, not 0: xgrammar's structural tags (which tool calls use) refuse a cap of 0.
JSON_MAX_WHITESPACE = 1
# JSON-schema keywords whose values are data, not schemas (nothing inside them is rewritten).
SCHEMA_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
# OpenAI's JSON mode promises an object (xgrammar's builtin JSON grammar also allows an array).
_ANY_JSON_OBJECT = '{"type": "object"}'
# xgrammar (through 0.2.9, mlc-ai/xgrammar#800) writes a string with minLength/maxLength as a
# repetition of this class, which lets raw control characters (U+0000-U+001F but CR and LF) into
# the JSON, where RFC 8259 forbids them: json.loads then refuses the output. The grammar's text is
# rewritten to the class its unbounded strings use.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
# xgrammar's error text starts with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output.

    kind "json_object": any JSON object (spec must be ""); "json_schema": JSON valid against the
    JSON schema in spec; "ebnf": text of the EBNF grammar in spec (xgrammar/GBNF syntax, rule
    `root`); "structural_tag": xgrammar's structural-tag JSON in spec (free text with tagged,
    schema-constrained regions, as tool calling uses).
    """

    kind: StructuredOutputKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_output.spec must be a string, got {type(self.spec).__name__}")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("structured_output.spec must be empty for kind 'json_object'")
            return
        if not self.spec.strip():
            raise ValueError(f"structured_output.spec must not be empty for kind {self.kind!r}")
        if self.kind in ("json_schema", "structural_tag"):
            try:
                value = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output.spec: the {self.kind} is not valid JSON: {exc}") from None
            expected = (dict, bool) if self.kind == "json_schema" else (dict,)
            if not isinstance(value, expected):
                raise ValueError(
                    f"structured_output.spec: a {self.kind} must be a JSON object, got {type(value).__name__}"
                )

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> StructuredOutput:
        """From a schema as a dict or as JSON text. Key order is kept: the output writes the
        properties in the schema's order."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def ebnf(cls, grammar: str) -> StructuredOutput:
        return cls("ebnf", grammar)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any] | str) -> StructuredOutput:
        return cls("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's error message without its source-location prefix."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


class GrammarCache:
    """Compiles StructuredOutput constraints against one tokenizer, keeping the last `max_entries`
    compiled.

    The vocabulary is the model's (lm_head rows), which may be larger than the tokenizer's: the
    bitmask then covers every logit, and ids beyond the tokenizer are never allowed.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_entries: int = DEFAULT_GRAMMAR_CACHE_SIZE,
        max_threads: int = 8,
    ) -> None:
        import xgrammar as xgr

        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # xgrammar's own cache is off: this one is keyed by the request's exact (kind, spec).
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        # Compiles may run off the engine thread (LLMEngine.compile_grammar): the cache is locked,
        # the compile itself is not.
        self._lock = threading.Lock()
        self.max_entries = max_entries
        self.num_compiles = 0
        self.num_hits = 0

    def get(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar; ValueError with xgrammar's reason when the spec is not usable."""
        with self._lock:
            compiled = self._cache.get(structured)
            if compiled is not None:
                self._cache.move_to_end(structured)
                self.num_hits += 1
                return compiled
        compiled = self._compile(structured)
        with self._lock:
            self.num_compiles += 1
            self._cache[structured] = compiled
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        compiler = self._compiler
        try:
            if structured.kind == "json_object":
                # strict_mode=False: any properties, any values.
                return compiler.compile_json_schema(
                    _ANY_JSON_OBJECT, strict_mode=False, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
                )
            if structured.kind == "json_schema":
                # xgrammar's (and vLLM's) default strict mode: no properties or items beyond those
                # the schema names, so the output stays inside it where the schema leaves it open.
                grammar = self._xgr.Grammar.from_json_schema(
                    structured.spec, any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE
                )
                text = str(grammar)
                if _BOUNDED_STRING_CHAR in text:
                    grammar = self._xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
                return compiler.compile_grammar(grammar)
            if structured.kind == "ebnf":
                return compiler.compile_grammar(structured.spec)
            return compiler.compile_structural_tag(structured.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"structured_output: invalid {structured.kind}: {xgrammar_reason(exc)}") from None

    def __len__(self) -> int:
        return len(self._cache)
