"""The playground's "view code": the chat completion the page would send, written for curl, Python
(the official openai SDK) and JavaScript (fetch), with the page's model and settings and the API key
read from OPENAI_API_KEY (the page never shows a key)."""

import json
import shlex
from dataclasses import dataclass

from controlplane.dashboard.tenant.playground import PlaygroundPrompt


@dataclass(frozen=True)
class CodeSample:
    name: str
    language: str
    code: str


def _literal(value, indent: int = 4) -> str:
    # JSON of strings, numbers, lists and objects is also a Python and a JavaScript literal
    # (non-ASCII text escaped, so any editor and shell keeps it intact).
    return json.dumps(value, indent=indent, ensure_ascii=True)


def code_samples(*, base_url: str, prompt: PlaygroundPrompt) -> list[CodeSample]:
    """`base_url` is the API's, ending in /v1."""
    body = prompt.request_body()
    curl = (
        f"curl {shlex.quote(base_url + '/chat/completions')} \\\n"
        '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(_literal(body, indent=2))}"
    )
    arguments = "".join(
        f"    {name}={_literal(value).replace(chr(10), chr(10) + '    ')},\n" for name, value in body.items()
    )
    python = (
        "import os\n\nfrom openai import OpenAI\n\n"
        f'client = OpenAI(base_url={_literal(base_url)}, api_key=os.environ["OPENAI_API_KEY"])\n'
        f"completion = client.chat.completions.create(\n{arguments})\n"
        "print(completion.choices[0].message.content)"
    )
    javascript = (
        f"const response = await fetch({_literal(base_url + '/chat/completions')}, {{\n"
        '  method: "POST",\n'
        '  headers: {"Authorization": `Bearer ${process.env.OPENAI_API_KEY}`, "Content-Type": "application/json"},\n'
        f"  body: JSON.stringify({_literal(body, indent=2).replace(chr(10), chr(10) + '  ')}),\n"
        "});\n"
        "const completion = await response.json();\n"
        "console.log(completion.choices[0].message.content);"
    )
    return [
        CodeSample("curl", "shell", curl),
        CodeSample("Python", "python", python),
        CodeSample("JavaScript", "javascript", javascript),
    ]
