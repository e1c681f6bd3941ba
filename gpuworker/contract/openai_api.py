"""OpenAI-compatible request validation and response shapes for the worker's internal API.

Requests are validated with pydantic so every error names the offending field; the result is
turned into engine `SamplingParams` keyword arguments in one place.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

# The prompt's token count, on a replica's answer from its first token on: a gateway whose client
# leaves before the final usage still records the prompt tokens the request used.
PROMPT_TOKENS_HEADER = "x-prompt-tokens"
# Of those, the tokens the prefix cache served, on the same answers: the engine matched the cache
# when it first scheduled the request, before any output, so a stream can say it from the start.
CACHED_PROMPT_TOKENS_HEADER = "x-cached-prompt-tokens"


class ProtocolError(ValueError):
    """A request the API refuses, in OpenAI's error vocabulary."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """Types as OpenAI checks them: "4" is not a number and "yes" not a boolean (400 naming the
    field); an int is still a valid float (`"temperature": 1`)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI's bounds on logit_bias (the engine checks the same, and that the ids are in the vocabulary).
MAX_LOGIT_BIAS = 100
MAX_LOGIT_BIAS_ENTRIES = 300
# What the schema documents; `_SamplingFields._logit_bias` checks it first, in words.
_TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]+$")]
_Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]


class _SamplingFields(_Strict):
    model_config = ConfigDict(extra="ignore")

    model: str = ""
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions that vLLM users expect.
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # token id (a string, as JSON keys are) -> bias added to its logit before sampling.
    logit_bias: dict[_TokenIdKey, _Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # Only as many candidates as choices: more would need each candidate's whole answer scored
    # (vLLM's V1 engine refuses it too); 1, OpenAI's default, means the same as n.
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value):
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ProtocolError(
                'logit_bias: must be an object mapping token ids to biases, e.g. {"50256": -100}', param="logit_bias"
            )
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ProtocolError(
                f"logit_bias: {len(value)} tokens given; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed",
                param="logit_bias",
            )
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ProtocolError(
                    f"logit_bias: {key!r} is not a token id (a non-negative integer, as a string)", param="logit_bias"
                )
            if (
                isinstance(bias, bool)
                or not isinstance(bias, (int, float))
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
            ):
                raise ProtocolError(
                    f"logit_bias: the bias of token {key} is {bias!r}; it must be a number from "
                    f"{-MAX_LOGIT_BIAS} to {MAX_LOGIT_BIAS}",
                    param="logit_bias",
                )
        return value

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of not in (1, self.n):
            if self.best_of < self.n:
                raise ProtocolError(f"best_of: {self.best_of} must be at least n ({self.n})", param="best_of")
            raise ProtocolError(
                f"best_of: generating {self.best_of} candidates to return the best {self.n} is not "
                "supported; leave best_of out (or equal to n) and ask for the choices you want with n",
                param="best_of",
            )
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
            if any(not s for s in value):
                raise ValueError("stop sequences must be non-empty strings")
        elif value == "":
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def _sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        kwargs: dict[str, Any] = dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias={int(token): float(bias) for token, bias in (self.logit_bias or {}).items()} or None,
            # Each step's additions only: a stream sends them as they are and a whole answer is
            # joined once at its end (outputs.join_deltas), instead of the replica receiving the
            # answer so far, copied, every step.
            output_kind="delta",
        )
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# OpenAI's rule for function names (also what chat templates can print without escaping).
_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _function_name(value: str, param: str) -> str:
    if not _FUNCTION_NAME.match(value):
        raise ProtocolError(
            f"{param}: {value!r} is not a valid function name (1 to 64 letters, digits, '_' or '-')", param=param
        )
    return value


class JsonSchemaSpec(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict = Field(alias="schema")
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _function_name(value, "response_format.json_schema.name")


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="forbid")

    type: str
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.type not in RESPONSE_FORMAT_TYPES:
            raise ProtocolError(
                f"response_format.type: {self.type!r} is not supported; expected one of "
                f"{', '.join(RESPONSE_FORMAT_TYPES)}",
                param="response_format.type",
            )
        if self.type == "json_schema" and self.json_schema is None:
            raise ProtocolError(
                "response_format.json_schema: required when type is 'json_schema' (give name and schema)",
                param="response_format.json_schema",
            )
        if self.type != "json_schema" and self.json_schema is not None:
            raise ProtocolError(
                f"response_format.json_schema: only allowed when type is 'json_schema', not {self.type!r}",
                param="response_format.json_schema",
            )
        return self


class FunctionDefinition(_Strict):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Strict):
    class _Name(_Strict):
        name: str

    type: Literal["function"]
    function: _Name


class FunctionCall(_Strict):
    name: str
    arguments: str


class MessageToolCall(_Strict):
    """A tool call an assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


IMAGE_DETAILS = ("auto", "low", "high")
IMAGE_URL_SCHEMES = ("data:", "http://", "https://")


@dataclass(frozen=True)
class ImageInput:
    """An image a chat request refers to: where it is in the request (the part's dotted path, as
    errors name it, e.g. messages.1.content.2.image_url), its URL (a data: URL or http(s)) and the
    detail asked for."""

    param: str
    url: str
    detail: str = "auto"


def _content_part(part: Any, param: str, role: str) -> ImageInput | None:
    """One content part checked: a text part, or an image part (user messages only). Raises
    ProtocolError naming the part's field."""
    if not isinstance(part, dict):
        raise ProtocolError(f"{param}: a content part must be an object with a type", param=param)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ProtocolError(f"{param}.text: a text part needs its text as a string", param=f"{param}.text")
        return None
    if kind != "image_url":
        raise ProtocolError(
            f"{param}.type: {kind!r} is not a supported content part type; expected 'text' or 'image_url'",
            param=f"{param}.type",
        )
    if role != "user":
        raise ProtocolError(f"{param}: only user messages may carry images, not {role!r} ones", param=param)
    image = part.get("image_url")
    if not isinstance(image, dict):
        raise ProtocolError(
            f'{param}.image_url: must be an object like {{"url": "data:image/png;base64,..."}}',
            param=f"{param}.image_url",
        )
    url = image.get("url")
    if not isinstance(url, str) or not url.lower().startswith(IMAGE_URL_SCHEMES):
        shown = url if not isinstance(url, str) else url[:40]
        raise ProtocolError(
            f"{param}.image_url.url: {shown!r} is not an image URL; give a data: URL or an http(s) URL",
            param=f"{param}.image_url.url",
        )
    detail = image.get("detail", "auto")
    if detail not in IMAGE_DETAILS:
        raise ProtocolError(
            f"{param}.image_url.detail: {detail!r} is not one of {', '.join(IMAGE_DETAILS)}",
            param=f"{param}.image_url.detail",
        )
    return ImageInput(f"{param}.image_url", url, detail)


def images_refused_for(model_name: str) -> ProtocolError:
    """The 400 for images sent to a model that takes none (the gateway's and the replica's)."""
    return ProtocolError(
        f"model: {model_name!r} is a text-only model and cannot take images; send text only, or use a vision model",
        param="model",
        code="model_not_multimodal",
    )


def data_url_bytes(url: str) -> int | None:
    """The bytes a data: URL's base64 decodes to, from its length (None for another URL): what
    the gateway checks without decoding; the replica decodes it and checks again."""
    if url[:5].lower() != "data:":
        return None
    encoded = url.partition(",")[2].rstrip("=")
    return len(encoded) * 3 // 4


@dataclass(frozen=True)
class ImageRules:
    """What one model takes in a chat request's images, as the catalog says: none (a text-only
    model), or at most max_images of at most max_image_bytes each. The gateway and batch
    validation check requests by it before routing; the replica checks again, and the pixels."""

    model_name: str
    takes_images: bool
    max_images: int
    max_image_bytes: int

    def check(self, params: Sequence[str], sizes: Sequence[int | None]) -> None:
        """A request's image parts, by their places and (data: URLs) sizes (`data_url_bytes`).
        Raises ProtocolError naming the model, or the first part past a limit."""
        if not params:
            return
        if not self.takes_images:
            raise images_refused_for(self.model_name)
        if len(params) > self.max_images:
            param = params[self.max_images]
            raise ProtocolError(
                f"{param}: the request has {len(params)} images; {self.model_name!r} takes at most {self.max_images}",
                param=param,
                code="too_many_images",
            )
        for param, size in zip(params, sizes):
            if size is not None and size > self.max_image_bytes:
                raise ProtocolError(
                    f"{param}: the image is {size} bytes; {self.model_name!r} takes images of at most "
                    f"{self.max_image_bytes} bytes",
                    param=param,
                    code="invalid_image",
                )


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Any], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(
                part.get("text", "") for part in self.content if isinstance(part, dict) and part.get("type") == "text"
            )
        return self.content or ""

    def images(self, index: int) -> list[ImageInput]:
        """The message's image parts, checked (with its text parts); ProtocolError names a bad part."""
        if not isinstance(self.content, list):
            return []
        found = [_content_part(part, f"messages.{index}.content.{j}", self.role) for j, part in enumerate(self.content)]
        return [image for image in found if image is not None]

    def content_parts(self) -> list[dict]:
        """The content as multimodal chat templates read it: text parts and {"type": "image"} in
        the order sent."""
        if not isinstance(self.content, list):
            return [{"type": "text", "text": self.content or ""}]
        return [
            {"type": "image"} if part.get("type") == "image_url" else {"type": "text", "text": part.get("text", "")}
            for part in self.content
        ]

    def template_message(self, index: int) -> dict:
        """The message as chat templates read it: tool-call arguments as objects (templates print
        them with `tojson`), and keys only when set (Llama 3.1's template tests `'tool_calls' in
        message`)."""
        message: dict[str, Any] = {"role": self.role if self.role != "developer" else "system", "content": self.text()}
        if self.tool_calls:
            calls = []
            for j, call in enumerate(self.tool_calls):
                param = f"messages.{index}.tool_calls.{j}.function.arguments"
                try:
                    arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
                except ValueError as exc:
                    raise ProtocolError(f"{param}: not valid JSON ({exc})", param=param) from None
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            message["tool_calls"] = calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        self._check_tools()
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise ProtocolError(
                    f"messages.{i}.tool_call_id: a message with role 'tool' must say which tool call it answers",
                    param=f"messages.{i}.tool_call_id",
                )
            if message.tool_calls and message.role != "assistant":
                raise ProtocolError(
                    f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                    param=f"messages.{i}.tool_calls",
                )
            message.images(i)  # content parts must be text or well-formed images
            message.template_message(i)  # tool-call arguments must be JSON
        return self

    def images(self) -> list[ImageInput]:
        """Every image of the conversation, in order."""
        return [image for i, message in enumerate(self.messages) for image in message.images(i)]

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ProtocolError(
                f"tool_choice: {value!r} is not one of 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        return value

    def _check_tools(self) -> None:
        names: set[str] = set()
        for i, tool in enumerate(self.tools or ()):
            name = _function_name(tool.function.name, f"tools.{i}.function.name")
            if name in names:
                raise ProtocolError(
                    f"tools.{i}.function.name: {name!r} is defined twice", param=f"tools.{i}.function.name"
                )
            names.add(name)
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                raise ProtocolError(
                    f"tools.{i}.function.parameters: must be a JSON schema of type 'object'",
                    param=f"tools.{i}.function.parameters",
                )
        if self.tools is not None and not self.tools:
            raise ProtocolError("tools: give at least one tool, or leave tools out", param="tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ProtocolError("tool_choice: only allowed when tools are given", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ProtocolError(
                f"tool_choice.function.name: no tool is named {self.tool_choice.function.name!r}; the tools "
                f"are {', '.join(sorted(names))}",
                param="tool_choice.function.name",
            )
        if self.forces_tool_call and self.response_format is not None and self.response_format.type != "text":
            raise ProtocolError(
                "response_format: cannot be combined with a tool_choice that forces a tool "
                "call (the call's arguments already follow the function's schema)",
                param="response_format",
            )

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: 'auto' when tools are given, else 'none'."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def uses_tools(self) -> bool:
        return self.effective_tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.effective_tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def chat_messages(self) -> list[dict]:
        return [message.template_message(i) for i, message in enumerate(self.messages)]

    def template_tools(self) -> list[dict] | None:
        """The tools for the chat template (None with tool_choice 'none': the model is not told of
        tools it may not call, so it does not write calls that would only come back as text)."""
        if not self.uses_tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    def sampling_kwargs(self) -> dict[str, Any]:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_kwargs(self.max_completion_tokens or self.max_tokens, logprobs)


# Token ids first, tried in order: pydantic's default "smart" union validates a long list of ids
# against the other forms too, many times the CPU for the same result.
_PROMPT_FORMS = Field(union_mode="left_to_right")


class CompletionRequest(_SamplingFields):
    prompt: Union[list[int], str, list[str], list[list[int]]] = _PROMPT_FORMS
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if len(value) > 1 and not isinstance(value[0], int):
                raise ValueError("this worker takes one prompt per request")
            if isinstance(value[0], str) or isinstance(value[0], list):
                value = value[0]
        # Checked again once unwrapped: [""] and [[]] are empty prompts too.
        if not value:
            raise ValueError("prompt must not be empty")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        return self._sampling_kwargs(self.max_tokens, self.logprobs)


# Inputs in one /v1/embeddings request, as OpenAI limits them.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings: `input` is a string, a list of strings, a list of token ids or a list
    of token-id lists (token ids are encoded as given, without special tokens added)."""

    model: str
    input: Union[list[int], str, list[str], list[list[int]]] = _PROMPT_FORMS
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        if isinstance(value, str):
            value = [value]
        elif value and isinstance(value[0], int):
            value = [value]
        if not value:
            raise ValueError("input must not be empty")
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input holds {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request")
        for index, item in enumerate(value):
            if not item:
                raise ValueError(f"input item {index} must not be empty")
        return value

    # Embeddings come back whole: OpenAI has no stream for them, and a client asking for one is told.
    stream: bool = False

    @field_validator("stream")
    @classmethod
    def _stream(cls, value: bool) -> bool:
        if value:
            raise ProtocolError(
                "stream: embeddings are answered whole; streaming is not supported for /v1/embeddings", param="stream"
            )
        return value

    @property
    def n(self) -> int:
        """What the gateway's admission asks of every request: one answer (not a client's field)."""
        return 1

    @property
    def texts(self) -> list[str] | None:
        """The inputs as strings, or None when they were given as token ids."""
        return self.input if isinstance(self.input[0], str) else None


# Where a lone UTF-16 surrogate can come from: a JSON escape of one (a valid pair is decoded into
# one character) or its UTF-8 form, which json.loads lets through. Only bodies with one of these
# are searched, so ordinary bodies cost one scan of their bytes.
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_body(raw: bytes) -> dict:
    """A request body as a JSON object, or ProtocolError (400): not JSON or not UTF-8, nested too
    deeply for the parser, not an object, or holding a lone UTF-16 surrogate (not text: no
    tokenizer can read it)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ProtocolError("request body is nested too deeply to parse") from None
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise ProtocolError(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    if _SURROGATE_SOURCE.search(raw) and (where := _lone_surrogate(body)) is not None:
        raise ProtocolError(
            f"{where}: contains a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), which is not text",
            param=where,
        )
    return body


def _lone_surrogate(body: dict) -> str | None:
    """The dotted path of the first string (or object, for a key) in `body` with a lone surrogate."""
    stack: list[tuple[str, Any]] = [("", body)]  # iterative: the body may be nested deeply
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _LONE_SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                if _LONE_SURROGATE.search(key):
                    return path or "body"  # the object with the bad key (the key itself cannot be printed)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", item) for i, item in reversed(list(enumerate(value))))
    return None


def check_token_ids_fit(cls: type[BaseModel], body: dict, context_length: int) -> None:
    """Refuse token-id prompts (completions) or inputs (embeddings) too long for a model of
    `context_length` tokens, from their lengths alone: called before `parse_request`, which would
    first spend CPU on every id of a list that cannot be served. A completion's prompt must leave
    room for one generated token; an embedding's input may fill the context. The replica applies
    the exact rule with its own max_model_len, which is never above the catalog's context length.
    Raises ProtocolError (400, context_length_exceeded)."""
    if cls is CompletionRequest:
        for ids in _token_id_lists(body.get("prompt")):
            if len(ids) >= context_length:
                raise ProtocolError(
                    f"prompt has {len(ids)} tokens, which leaves no room to generate within the "
                    f"model's context of {context_length} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
    elif cls is EmbeddingRequest:
        for index, ids in enumerate(_token_id_lists(body.get("input"))):
            if len(ids) > context_length:
                raise ProtocolError(
                    f"input: input {index} has {len(ids)} tokens; this model takes at most {context_length}",
                    param="input",
                    code="context_length_exceeded",
                )


def _token_id_lists(value: Any) -> list[list]:
    """The lists of token ids in a prompt or input as sent: the value itself when it is a list of
    ids, its lists when it is a list of them, none for text."""
    if not isinstance(value, list) or not value or isinstance(value[0], str):
        return []
    if isinstance(value[0], list):
        return [item for item in value if isinstance(item, list)]
    return [value]


def parse_request(cls: type[BaseModel], body: Any):
    """Validate a JSON body, raising ProtocolError that names the first bad field."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if isinstance((first.get("ctx") or {}).get("error"), ProtocolError):
            raise first["ctx"]["error"] from None  # a validator that named its field itself
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ProtocolError(f"{param}: {message}" if param else message, param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int, **extra: Any) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        **extra,
    }
