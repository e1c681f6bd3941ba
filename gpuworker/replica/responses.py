"""OpenAI response bodies for the worker server: errors, whole responses and SSE chunk streams.

Every response's usage also reports `gpu_time_s`, the request's share of engine step time, so the
control plane can price requests against GPU cost.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from gpuworker.contract.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ImageInput,
    ProtocolError,
    now,
    parse_json_body,
    parse_request,
    usage_dict,
)
from gpuworker.engine.multimodal import expand_image_tokens
from gpuworker.engine.outputs import CompletionOutput, RequestOutput
from gpuworker.engine.prompts import PromptTokenizer, TokenizedPrompt
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.replica.engine_holder import EngineHolder
from gpuworker.replica.generic_tool_calls import (
    GenericToolParser,
    generic_calls_text,
    generic_result_text,
    generic_tools_instruction,
)
from gpuworker.replica.response_format import (
    generic_tools_constraint,
    response_format_constraint,
    tool_choice_constraint,
)
from gpuworker.replica.tool_calls import ToolCallFormat, ToolCallParser, detect_tool_format
from gpuworker.replica.tool_prompt import FALLBACK_FORMAT, tools_system_prompt, with_tools_in_prompt


def error_response(
    message: str,
    status: int = 400,
    param: str | None = None,
    code: str | None = None,
    type: str = "invalid_request_error",
) -> JSONResponse:
    return JSONResponse(
        ProtocolError(message, param=param, code=code, status=status, type=type).to_dict(), status_code=status
    )


def engine_error(exc: ValueError, prompt_field: str) -> JSONResponse:
    message = str(exc)
    code = "context_length_exceeded" if "max_model_len" in message else None
    param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    if code is not None:
        param = prompt_field if param is None else param
    return error_response(message, param=param, code=code)


def drain_expired_error(timeout_s: float) -> ProtocolError:
    """Why a request was cut short: the replica was being stopped and its drain timeout passed."""
    return ProtocolError(
        f"the replica is shutting down and this request did not finish within the "
        f"drain timeout ({timeout_s:g}s); retry it",
        status=503,
        type="server_error",
        code="replica_draining",
    )


@dataclass
class ToolParsing:
    """How a chat request's output is read for tool calls: the model's format and the callable
    names, or (generic) the one JSON object of tool_choice "auto" on a template without tools."""

    fmt: ToolCallFormat
    names: frozenset[str]
    generic: bool = False

    def parser(self) -> ToolCallParser | GenericToolParser:
        return GenericToolParser() if self.generic else ToolCallParser(self.fmt, self.names)


@dataclass
class RequestPlan:
    """A request ready for the engine: what it asked, its prompt tokenized, how to sample."""

    parsed: ChatCompletionRequest | CompletionRequest
    prompt: TokenizedPrompt
    params: SamplingParams
    tool_parsing: ToolParsing | None = None
    # A chat request's image parts, in order (their bytes are loaded after planning).
    images: list[ImageInput] = field(default_factory=list)


def plan_request(prompts: PromptTokenizer, raw: bytes, chat: bool) -> RequestPlan:
    """A /v1 request body parsed and checked, its prompt rendered and tokenized. Megabytes of it
    take seconds of CPU, so the server calls this in a worker thread, never on its event loop.
    Raises ProtocolError / ValueError (400)."""
    request = parse_request(ChatCompletionRequest if chat else CompletionRequest, parse_json_body(raw))
    if chat:
        return plan_chat(prompts, request)
    return RequestPlan(request, prompts.tokenize(request.prompt), SamplingParams(**request.sampling_kwargs()))


def plan_chat(prompts: PromptTokenizer, request: ChatCompletionRequest) -> RequestPlan:
    """A chat request, prepared by `prompts` (the engine's): the prompt (tools rendered by the model's
    own chat template, or written into the system prompt when the template cannot: tool_prompt), the
    sampling parameters with the output constraint of response_format, of a forced tool call or
    of the generic format (tool_choice "auto" on a template without tools: generic_tool_calls),
    and how to read tool calls back. Raises ProtocolError / ValueError (400)."""
    kwargs = request.sampling_kwargs()
    tool_parsing = None
    constraint = response_format_constraint(request.response_format)
    messages, tools = request.chat_messages(), request.template_tools()
    if getattr(prompts.model_config, "vision", None) is not None:
        # A vision model's template writes its image placeholder for each {"type": "image"} part.
        for message, sent in zip(messages, request.messages):
            if isinstance(sent.content, list):
                message["content"] = sent.content_parts()
    if request.uses_tools:
        template = getattr(prompts.tokenizer, "chat_template", None) if prompts.tokenizer is not None else None
        try:
            fmt = detect_tool_format(template if isinstance(template, str) else None, prompts.model_config.model_type)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="tools") from None
        names = frozenset(tool.function.name for tool in request.tools or ())
        if fmt is None and not request.forces_tool_call:
            # The template cannot show tools and the model may answer either way: one JSON object,
            # a call or the response, chosen early and kept well-formed by the grammar.
            instruction = generic_tools_instruction(tools or [], parallel_tool_calls=request.parallel_tool_calls)
            messages = with_tools_in_prompt(messages, instruction, generic_calls_text, generic_result_text)
            tools, tool_parsing = None, ToolParsing(FALLBACK_FORMAT, names, generic=True)
            constraint = generic_tools_constraint(request)
        else:
            if fmt is None:  # the template cannot show tools: they go into the system prompt instead
                messages = with_tools_in_prompt(messages, tools_system_prompt(tools or []))
                fmt, tools = FALLBACK_FORMAT, None
            tool_parsing = ToolParsing(fmt, names)
            constraint = tool_choice_constraint(request, fmt) or constraint
    params = SamplingParams(**kwargs, structured_output=constraint)
    # Only the token ids: a chat's output does not echo the rendered prompt.
    prompt = TokenizedPrompt(None, prompts.render_chat(messages, tools=tools).token_ids)
    return RequestPlan(request, prompt, params, tool_parsing, request.images())


def with_image_tokens(prompts: PromptTokenizer, prompt: TokenizedPrompt, images: list[Any]) -> TokenizedPrompt:
    """The chat prompt with each image's placeholder token repeated as many times as the image
    (preprocessed: engine.multimodal.ImageInput) fills; ValueError when placeholders and images differ."""
    vision = prompts.model_config.vision
    if vision is None:  # a text-only engine refuses the images itself
        return prompt
    token_ids = list(prompt.token_ids)
    boi, eoi = getattr(vision, "boi_token_id", None), getattr(vision, "eoi_token_id", None)
    if boi is not None and eoi is not None and vision.image_token_id not in token_ids:
        # Gemma 3's template writes <start_of_image> alone; its processor's image sequence goes there.
        gap = prompts.tokenizer.encode("\n\n", add_special_tokens=False)
        sequence = [*gap, boi, vision.image_token_id, eoi, *gap]
        token_ids = [t for token in token_ids for t in (sequence if token == boi else (token,))]
    try:
        token_ids = expand_image_tokens(token_ids, images, vision.image_token_id)
    except ValueError as exc:
        raise ValueError(f"messages: the model's chat template did not place the images: {exc}") from None
    return TokenizedPrompt(None, token_ids)


def _stop_string(choice: CompletionOutput) -> dict:
    """`stop_reason`: the stop string that ended the choice (vLLM's field), when one did."""
    return {"stop_reason": choice.stop_reason} if isinstance(choice.stop_reason, str) else {}


def _finish_reason(choice: CompletionOutput, made_calls: bool) -> str | None:
    # OpenAI says "tool_calls" when the model stopped after calling; a cut-off reply stays "length".
    return "tool_calls" if made_calls and choice.finish_reason == "stop" else choice.finish_reason


class Responder:
    """Turns engine outputs into OpenAI response bodies (whole or as SSE chunks)."""

    def __init__(
        self,
        holder: EngineHolder,
        parsed: Any,
        request_id: str,
        chat: bool,
        tokenizer: Any,
        tool_parsing: ToolParsing | None = None,
    ):
        self.holder, self.parsed, self.request_id, self.chat = holder, parsed, request_id, chat
        self.tokenizer = tokenizer
        self.tool_parsing = tool_parsing
        self.created = now()
        self.object = "chat.completion" if chat else "text_completion"

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        if self.chat:

            def item(token_id, logprob):
                token = self._token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {
                "content": [
                    {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
                    for e in entries
                ]
            }
        tokens = [self._token(e.token_id) for e in entries]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): lp for t, lp in e.top_logprobs} for e in entries],
            "text_offset": offsets,
        }

    def _usage(self, output: RequestOutput, completion_tokens: int) -> dict:
        return usage_dict(
            len(output.prompt_token_ids),
            completion_tokens,
            prompt_tokens_details={"cached_tokens": output.num_cached_tokens},
            gpu_time_s=output.metrics.gpu_time_s,
        )

    def full(self, output: RequestOutput) -> dict:
        """The response body of a whole answer: `output` joined from the request's deltas."""
        choices = []
        for c in output.outputs:
            logprobs = self._logprobs(c.logprobs)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": c.text}
                finish_reason = c.finish_reason
                if self.tool_parsing is not None:
                    parsed = self.tool_parsing.parser().whole(c.text)
                    message["content"] = parsed.content
                    if parsed.tool_calls:
                        message["tool_calls"] = [call.to_dict() for call in parsed.tool_calls]
                    finish_reason = _finish_reason(c, bool(parsed.tool_calls))
                choices.append(
                    {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
                    | _stop_string(c)
                )
            else:
                text = (output.prompt or "") + c.text if self.parsed.echo else c.text
                choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {
            "id": self.request_id,
            "object": self.object,
            "created": self.created,
            "model": self.holder.config.model_name,
            "choices": choices,
            "usage": self._usage(output, output.num_generated_tokens),
        }

    @staticmethod
    def _tool_delta(parser: ToolCallParser | GenericToolParser, choice: CompletionOutput) -> dict:
        """A chat delta with tool calls read out of the text: content, then tool_calls deltas."""
        said = parser.feed(choice.delta_text)
        if choice.finish_reason is not None:
            rest = parser.finish()
            said.content += rest.content
            said.tool_calls += rest.tool_calls
        delta: dict[str, Any] = {}
        if said.content:
            delta["content"] = said.content
        if said.tool_calls:
            delta["tool_calls"] = said.tool_calls
        return delta

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.request_id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.holder.config.model_name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def sse(
        self, first: RequestOutput, stream: AsyncIterator[RequestOutput], request: Request
    ) -> AsyncIterator[str]:
        engine = self.holder.engine
        metrics = self.holder.metrics
        finished = False
        generated = 0  # tokens so far: the outputs are deltas (output_kind="delta")
        parsers = [self.tool_parsing.parser() for _ in first.outputs] if self.tool_parsing and self.chat else None
        try:
            if self.chat:  # OpenAI opens every choice with the role
                yield self._chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for c in first.outputs
                    ]
                )
            output = first
            last_time = time.monotonic()
            while True:
                if (
                    output.finished
                    and self.holder.drain_expired
                    and any(c.finish_reason == "abort" for c in output.outputs)
                ):
                    finished = True  # aborted by the drain: the client gets an error, not "abort"
                    yield f"data: {json.dumps(drain_expired_error(self.holder.drain_timeout_s).to_dict())}\n\n"
                    break
                choices = []
                generated += sum(len(c.delta_token_ids) for c in output.outputs)
                for c in output.outputs:
                    if not c.delta_text and not c.delta_token_ids and c.finish_reason is None:
                        continue
                    logprobs = self._logprobs(c.logprobs)
                    if parsers is not None:
                        delta = self._tool_delta(parsers[c.index], c)
                        if not delta and logprobs is None and c.finish_reason is None:
                            continue  # held back: it may be the start of a tool call
                        choices.append(
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": logprobs,
                                "finish_reason": _finish_reason(c, bool(parsers[c.index].calls)),
                            }
                        )
                    elif self.chat:
                        if not c.delta_text and logprobs is None and c.finish_reason is None:
                            # Token ids that are no text yet (part of a character, or a stop string
                            # held back): OpenAI sends no empty delta, only the last one beside its
                            # finish_reason.
                            continue
                        choices.append(
                            {
                                "index": c.index,
                                "delta": {"content": c.delta_text} if c.delta_text else {},
                                "logprobs": logprobs,
                                "finish_reason": c.finish_reason,
                            }
                            | _stop_string(c)
                        )
                    else:
                        choices.append(
                            {
                                "index": c.index,
                                "text": c.delta_text,
                                "logprobs": logprobs,
                                "finish_reason": c.finish_reason,
                            }
                        )
                if choices:
                    yield self._chunk(choices)
                if output.finished:
                    finished = True
                    self.holder.record_finished(output, generated)
                    if self.parsed.include_usage:
                        yield self._chunk([], usage=self._usage(output, generated))
                    break
                output = await anext(stream)
                t = time.monotonic()
                # One output may stand for several steps the stream fell behind on: the gap is
                # shared among its tokens, as each token's latency.
                tokens = max(1, sum(len(c.delta_token_ids) for c in output.outputs))
                for _ in range(tokens):
                    metrics.inter_token_latency.observe((t - last_time) / tokens)
                last_time = t
            yield "data: [DONE]\n\n"
        except ValueError as exc:
            yield f"data: {json.dumps(ProtocolError(str(exc)).to_dict())}\n\ndata: [DONE]\n\n"
        except Exception as exc:  # the engine step failed: end the stream in words, never silently
            error = ProtocolError(f"the engine failed: {type(exc).__name__}: {exc}", status=500, type="server_error")
            yield f"data: {json.dumps(error.to_dict())}\n\ndata: [DONE]\n\n"
        finally:
            if not finished:
                # Client gone (cancellation) or an error: free the request's KV blocks now. Not
                # awaited directly, because a cancelled task cannot await.
                asyncio.ensure_future(engine.abort(self.request_id))
            await stream.aclose()
