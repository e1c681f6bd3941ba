"""The Quickstart: a tenant's first requests to the API in curl, Python (the openai SDK) and
JavaScript (the openai npm package), for one of its keys and a model that key may call.

The key is read from OPENAI_API_KEY in every sample; the line that sets it carries the whole key
only in the response that created it (the page never has it again), else the key's prefix."""

import json
import shlex

from controlplane.accounts.models import ApiKey
from controlplane.catalog.models import Model
from controlplane.catalog.selectors import models_for_playground, text_models_for_key
from controlplane.dashboard.tenant.playground_code import CodeSample
from controlplane.fleet.selectors import first_ready_chat_model

# Shown in place of a model's name while the key may call none.
NO_MODEL = "MODEL_NAME"
FIRST_MESSAGE = "Say hello in five words."


def first_model_for(api_key: ApiKey | None) -> Model | None:
    """The model the samples name: of the enabled text models `api_key` may call (any, without a
    key), the one the playground would offer first (a chat model ready now), else the first."""
    models = models_for_playground() if api_key is None else text_models_for_key(api_key=api_key)
    return first_ready_chat_model(models=models) or models.first()


def key_text(*, api_key: ApiKey | None, plaintext: str | None = None) -> str:
    """What the samples set OPENAI_API_KEY to: the whole key right after creation, else its prefix."""
    if plaintext is not None:
        return plaintext
    return f"{api_key.prefix}…" if api_key is not None else "sk-…"


def quickstart_samples(*, base_url: str, key: str, model: str) -> list[CodeSample]:
    """`base_url` is the API's, ending in /v1."""
    body = {"model": model, "messages": [{"role": "user", "content": FIRST_MESSAGE}]}
    curl = (
        f"export OPENAI_API_KEY={shlex.quote(key)}\n\n"
        f"curl {shlex.quote(base_url + '/chat/completions')} \\\n"
        '  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(json.dumps(body, ensure_ascii=True))}"
    )
    messages = json.dumps(body["messages"], ensure_ascii=True)
    python = (
        f"# pip install openai; export OPENAI_API_KEY={shlex.quote(key)}\n"
        "import os\n\nfrom openai import OpenAI\n\n"
        f'client = OpenAI(base_url={json.dumps(base_url)}, api_key=os.environ["OPENAI_API_KEY"])\n'
        f"completion = client.chat.completions.create(model={json.dumps(model)}, messages={messages})\n"
        "print(completion.choices[0].message.content)"
    )
    javascript = (
        "// quickstart.mjs (an ES module: top-level await)\n"
        f"// npm install openai; export OPENAI_API_KEY={shlex.quote(key)}\n"
        'import OpenAI from "openai";\n\n'
        f"const client = new OpenAI({{ baseURL: {json.dumps(base_url)}, apiKey: process.env.OPENAI_API_KEY }});\n"
        "const completion = await client.chat.completions.create(\n"
        f"  {{ model: {json.dumps(model)}, messages: {messages} }},\n);\n"
        "console.log(completion.choices[0].message.content);"
    )
    return [
        CodeSample("curl", "shell", curl),
        CodeSample("Python", "python", python),
        CodeSample("JavaScript", "javascript", javascript),
    ]


def quickstart_context(*, base_url: str, api_key: ApiKey | None, plaintext: str | None = None) -> dict:
    """What the Quickstart's samples partial shows for `api_key` (None: the tenant has none yet)."""
    model = first_model_for(api_key)
    return {
        "base_url": base_url,
        "quickstart_key": api_key,
        "quickstart_model": model,
        "samples": quickstart_samples(
            base_url=base_url,
            key=key_text(api_key=api_key, plaintext=plaintext),
            model=model.public_name if model is not None else NO_MODEL,
        ),
        "full_key_shown": plaintext is not None,
    }
