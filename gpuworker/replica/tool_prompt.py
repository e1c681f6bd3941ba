"""Tool calling on a model whose chat template does not render tools: the tools go into the prompt.

The tool definitions (name, description and JSON schema of each function) are written into the
system message with an instruction to answer with Hermes-style blocks,
    <tool_call>
    {"name": "<function-name>", "arguments": <arguments-json-object>}
    </tool_call>
which the Hermes parser reads back and the forced-call grammar (tool_choice "required" or a named
function) writes. Earlier calls and tool results in the conversation are written as text in the
same format, so the template sees only system, user and assistant messages with plain content.
This is the format of forced calls (whose grammar writes the blocks); `tool_choice: "auto"` uses
the generic format instead (gpuworker.replica.generic_tool_calls), through the same rewriting.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gpuworker.replica.tool_calls import HERMES, ToolCallFormat

# The format the fallback prompt asks for.
FALLBACK_FORMAT: ToolCallFormat = HERMES


def tools_system_prompt(tools: list[dict]) -> str:
    """The instruction and the tool definitions, as system-prompt text."""
    definitions = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query. The functions, "
        "with the JSON schema of their arguments, are within <tools></tools> tags:\n"
        f"<tools>\n{definitions}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments within "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
        "Function results come back within <tool_response></tool_response> tags. "
        "When no function is needed, answer the user directly."
    )


def call_text(name: str, arguments: object) -> str:
    """One call as the fallback format writes it (`arguments` a decoded JSON value)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def calls_text(calls: list[dict]) -> str:
    """An assistant's calls (template_message shape) as <tool_call> blocks."""
    return "\n".join(call_text(call["function"]["name"], call["function"]["arguments"]) for call in calls)


def result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def with_tools_in_prompt(
    messages: list[dict],
    instruction: str,
    write_calls: Callable[[list[dict]], str] = calls_text,
    write_result: Callable[[str], str] = result_text,
) -> list[dict]:
    """`messages` (as chat templates read them, see ChatMessage.template_message) rewritten for a
    template without tools: `instruction` (the tool definitions and the format to answer in) before
    the first system message's text (a system message is added when there is none), an assistant's
    calls as text after its text, and tool results as a user message (consecutive results in one
    message, so that templates which insist on alternating roles accept the conversation).
    `write_calls` and `write_result` write them; by default as the Hermes blocks above."""
    out: list[dict] = []
    if messages and messages[0]["role"] == "system":
        system_text = messages[0]["content"]
        out.append({"role": "system", "content": f"{system_text}\n\n{instruction}" if system_text else instruction})
        messages = messages[1:]
    else:
        out.append({"role": "system", "content": instruction})
    previous_was_tool = False
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            calls = write_calls(message["tool_calls"])
            out.append({"role": "assistant", "content": "\n".join(filter(None, [message["content"], calls]))})
        elif role == "tool":
            response = write_result(message["content"])
            if previous_was_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
        else:
            out.append({"role": role, "content": message["content"]})
        previous_was_tool = role == "tool"
    return out
