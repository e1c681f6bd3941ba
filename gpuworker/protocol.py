"""OpenAI-compatible request validation and response shapes for the worker's internal API.

Requests are validated with pydantic so every error names the offending field; the result is
turned into engine `SamplingParams` keyword arguments in one place.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ProtocolError(ValueError):
    """A request the API refuses, in OpenAI's error vocabulary."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
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
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        return kwargs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("only response_format type 'text' is supported by this worker")
        return self

    def chat_messages(self) -> list[dict]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                for m in self.messages]

    def sampling_kwargs(self) -> dict[str, Any]:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_kwargs(self.max_completion_tokens or self.max_tokens, logprobs)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
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
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        return self._sampling_kwargs(self.max_tokens, self.logprobs)


def parse_request(cls: type[BaseModel], body: Any):
    """Validate a JSON body, raising ProtocolError that names the first bad field."""
    if not isinstance(body, dict):
        raise ProtocolError("request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise ProtocolError(f"{param}: {message}" if param else message, param=param) from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage_dict(prompt_tokens: int, completion_tokens: int, **extra: Any) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, **extra}
