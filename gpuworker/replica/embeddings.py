"""POST /v1/embeddings on a replica of an encoder: OpenAI's request and response shapes over the
embedding engine. `dimensions` cuts a vector only where the model declares Matryoshka dimensions
(then it is renormalised); any other value than the model's own is refused.
"""

from __future__ import annotations

import asyncio
import base64

import torch
import torch.nn.functional as F
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gpuworker.contract.openai_api import EmbeddingRequest, ProtocolError, parse_json_body, parse_request, usage_dict
from gpuworker.engine.embedding_engine import EmbeddingEngine
from gpuworker.replica.responses import error_response


def _plan(engine: EmbeddingEngine, raw: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
    parsed = parse_request(EmbeddingRequest, parse_json_body(raw))
    dims = parsed.dimensions
    if dims is not None and dims != engine.dimensions and dims not in engine.model.head.matryoshka_dimensions:
        allowed = sorted({engine.dimensions, *engine.model.head.matryoshka_dimensions})
        raise ProtocolError(
            f"dimensions: this model gives vectors of {allowed} dimensions, not {dims}", param="dimensions"
        )
    try:
        token_ids = engine.tokenize(parsed.texts) if parsed.texts is not None else engine.check(parsed.input)
    except ValueError as exc:
        raise ProtocolError(f"input: {exc}", param="input") from None
    return parsed, token_ids


def _encode(vector: torch.Tensor, dimensions: int | None, encoding_format: str):
    if dimensions is not None and dimensions < vector.shape[0]:
        vector = F.normalize(vector[:dimensions], dim=0)
    if encoding_format == "base64":  # little-endian float32, as OpenAI's SDK decodes it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def embeddings_response(
    parsed: EmbeddingRequest, model_name: str, vectors: list[torch.Tensor], prompt_tokens: int
) -> dict:
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(v, parsed.dimensions, parsed.encoding_format)}
        for i, v in enumerate(vectors)
    ]
    usage = usage_dict(prompt_tokens, 0)
    del usage["completion_tokens"]  # OpenAI's embedding usage: prompt_tokens and total_tokens
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


async def embeddings(request: Request, engine: EmbeddingEngine | None, model_name: str) -> Response:
    if engine is None:
        return error_response(
            f"{model_name!r} is a generative model; use /v1/chat/completions or /v1/completions",
            param="model",
            code="wrong_model_kind",
        )
    raw = await request.body()
    try:
        # Off the event loop: parsing and tokenizing 2048 inputs takes a while.
        parsed, token_ids = await asyncio.to_thread(_plan, engine, raw)
    except ProtocolError as exc:
        return JSONResponse(exc.to_dict(), status_code=exc.status)
    vectors = await engine.embed(token_ids)
    body = await asyncio.to_thread(embeddings_response, parsed, model_name, vectors, sum(map(len, token_ids)))
    return JSONResponse(body)
