"""POST /v1/chat/completions, /v1/completions and /v1/embeddings: validate, admit (rate limits,
then credit), route to a replica with one retry elsewhere before the first token, relay, settle.
The three share this one path; they differ only in their request schema and the model kind they
serve (`ENDPOINTS`).
"""

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from controlplane.gateway.body_check import BodyError, CheckedBody
from controlplane.gateway.cold_start import cold_start_header
from controlplane.gateway.dialects import Dialect, StreamTranslator
from controlplane.gateway.errors import (
    GatewayError,
    bad_request,
    model_not_allowed,
    model_not_found,
    overloaded,
    unavailable,
)
from controlplane.gateway.holds import CANCELLED, COMPLETED, FAILED, Flight
from controlplane.gateway.process import Gateway
from controlplane.gateway.relay import ReplicaFailed, StreamRelay, is_first_token, wait_for_disconnect
from controlplane.gateway.replica_choice import affinity_choice, prefix_key_header
from controlplane.gateway.request_body import read_body
from controlplane.gateway.selectors import KeyGrant, ModelRoute, ReplicaRoute
from controlplane.gateway.shared import Admission
from controlplane.gateway.upstream import UpstreamError, UpstreamResponse
from gpuworker.contract.openai_api import (
    CACHED_PROMPT_TOKENS_HEADER,
    PROMPT_TOKENS_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ProtocolError,
)
from gpuworker.contract.tenancy import tenancy_headers

logger = logging.getLogger(__name__)

_ATTEMPTS = 2  # the first replica, then once more on another
# Asking a replica whether an abandoned request had started: a replica this slow is failing anyway.
_STARTED_QUERY_TIMEOUT_S = 2.0


# Endpoint -> (its request schema, whether it serves models of kind "embedding" or the others).
ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, False),
    "/v1/completions": (CompletionRequest, False),
    "/v1/embeddings": (EmbeddingRequest, True),
}


async def serve(
    gw: Gateway,
    request: Request,
    request_id: str,
    *,
    path: str,
    dialect: Dialect | None = None,
    grant: KeyGrant | None = None,
) -> Response:
    """`dialect`: the request is in another API's shape, translated into a chat completion's
    (`path` is then /v1/chat/completions) and its answer back. `grant`: the request runs again
    without its caller (a background response taken over), under its key's grant as read now."""
    schema, for_embeddings = ENDPOINTS[path]
    authorization = (dialect or _OPENAI).authorization(request)
    try:
        raw = await read_body(request, gw.config.max_request_bytes)  # bounded before any other work
    except GatewayError:
        await gw.keys.note_refused_grant(request, authorization)  # whose refusal it is, if known
        raise
    if grant is None:
        grant = await gw.keys.request_grant(request, authorization)
    if dialect is not None:
        raw = await dialect.translate(gw, grant, raw)
    admission = None
    if not gw.bodies.parses_inline(raw):
        # Parsing a large body is work the key's limits admit, as they admit its tokens: it counts
        # against the key's and the tenant's rate and concurrency limits before it is parsed. A
        # small body is parsed first, so that admission and the choice of replica are one call.
        admission = _admitted(await gw.shared.admit(grant, request_id))
    flight = None
    try:
        checked = await gw.bodies.check(
            grant.tenant_id, raw, schema, gw.config.affinity_prefix_chars, await gw.routing.model_limits()
        )
        if checked.json_error:
            raise _invalid(checked.error)
        model = await _model(gw, grant, checked.model)
        request.state.model, request.state.model_id = model.public_name, model.model_id  # for refusals.request_counted
        gw.spawn(gw.traffic.record(model.model_id, time.time()))  # off the request's path
        if checked.error is not None:
            raise _invalid(checked.error)
        if (model.kind == "embedding") != for_embeddings:
            kind, use = (
                ("an embedding", "/v1/embeddings")
                if model.kind == "embedding"
                else ("a generative", "/v1/chat/completions or /v1/completions")
            )
            raise bad_request(
                f"{model.public_name!r} is {kind} model; use {use}.", param="model", code="wrong_model_kind"
            )
        _check_images(model, checked)
        idempotency = None if checked.stream else request.headers.get("idempotency-key")
        if idempotency:
            scope = f"{grant.tenant_id}:{hashlib.sha256(idempotency.encode()).hexdigest()}"
            fingerprint = hashlib.sha256(request.url.path.encode() + b"\0" + raw).hexdigest()
            if (replay := await _idempotent_replay(gw, scope, fingerprint, request_id)) is not None:
                return replay
        stored = False
        try:
            key, tokens = checked.affinity_key, model.prompt_tokens_estimate(len(raw), checked)
            replicas, cold_start_s = model.ready, None
            if admission is not None:  # admitted before its body was parsed
                first = (
                    await gw.shared.pick(replicas, request_id, affinity_choice(key, replicas), tokens)
                    if replicas
                    else None
                )
            elif replicas:  # rate limits, concurrency limits and the choice of replica: one round trip to Redis
                admission, first = await gw.shared.admit_and_pick(
                    grant, request_id, replicas, affinity_choice(key, replicas), tokens
                )
                _admitted(admission)
            else:  # admitted (and, below, its credit held) before it waits: a refusal comes at once
                admission, first = _admitted(await gw.shared.admit(grant, request_id)), None
            if first is not None and model.over_objective(first):
                # Shed before any credit is held: freed at once, charged nothing, counted as demand.
                admission = None
                await gw.shared.finish(request_id, grant=grant, replica_id=first.replica_id)
                gw.spawn(gw.traffic.record_shed(model.model_id, time.time()))
                raise overloaded(model.public_name, first.predicted_wait_s, model.ttft_objective_s)
            flight = request.state.flight = Flight(gw, request_id, grant, model, checked.n)
            flight.image_count, flight.routed_tokens = len(checked.image_params), tokens
            if first is not None:  # picked: a refusal at the hold frees its place there too
                flight.replica_id = first.replica_id
            try:
                await flight.hold()
                if first is None:
                    # It waits for a replica to start, holding its credit and its slots but charged
                    # nothing: leaving costs nothing, and nobody out of credit or over a limit wakes a model.
                    waited = await _client_present(request, gw.cold_starts.ready_replicas(model, request_id))
                    if waited is _GONE:
                        return Response(status_code=499)  # nobody reads it: the client is gone
                    replicas, cold_start_s = waited
                    # Not shed, whatever the replica's load report predicts: shedding refuses a
                    # request at once, before it waits, and this one has waited its cold start (its
                    # first token is late already). Shed now, it would lose that wait and its place
                    # ahead of the requests arriving now; served, its prompt tokens join the routed
                    # work the objective sheds those by.
                    first = await gw.shared.pick(replicas, request_id, affinity_choice(key, replicas), tokens)
                    flight.replica_id = first.replica_id
                headers = {**admission.headers(), "x-request-id": request_id, **cold_start_header(cold_start_s)}
                response = await _served(gw, request, flight, replicas, first, path, raw, checked, headers, dialect)
                if idempotency and response.status_code == 200:
                    try:
                        await gw.shared.idempotency_store(
                            scope,
                            {
                                "state": "done",
                                "fingerprint": fingerprint,
                                "status": 200,
                                "body": response.body.decode(),
                            },
                        )
                        stored = True
                    except Exception:  # the answer is served and billed: deliver it regardless
                        logger.warning("could not store the result for an Idempotency-Key", exc_info=True)
                return response
            finally:
                # Whatever ended the request before it was served (an error, a refusal) releases it
                # unbilled; a stream that started is the relay's to finish.
                if not flight.settled and (not checked.stream or flight.first_token_at is None):
                    await flight.end(None)
        finally:
            if idempotency and not stored:
                await gw.shared.idempotency_abandon(scope)
    finally:
        if flight is None and admission is not None and admission.allowed:
            # Admitted, then refused before its flight began (a bad body, an unknown model): its
            # slots are freed here, as a flight's end would.
            await _release_admitted(gw, grant, request_id)


_OPENAI = Dialect()  # the API's own: only its authorization is asked for


async def _served(
    gw: Gateway,
    request: Request,
    flight: Flight,
    replicas: tuple[ReplicaRoute, ...],
    first: ReplicaRoute,
    path: str,
    raw: bytes,
    checked: CheckedBody,
    headers: dict[str, str],
    dialect: Dialect | None,
) -> Response | StreamRelay:
    """The answer (a whole one, or a stream from its first token on), in the dialect's shape."""
    chat, key = ENDPOINTS[path][0] is ChatCompletionRequest, checked.affinity_key
    if checked.stream:
        translator = dialect.stream() if dialect is not None else None
        work = _stream(
            gw,
            flight,
            replicas,
            first,
            path,
            checked.upstream_body,
            key,
            headers,
            chat=chat,
            include_usage=checked.include_usage and translator is None,
            translator=translator,
        )
        response = await _unless_client_leaves(gw, request, flight, replicas, stream=True, work=work)
    else:
        work = _complete(gw, flight, replicas, first, path, raw, key, headers)
        response = await _unless_client_leaves(gw, request, flight, replicas, stream=False, work=work)
    if dialect is None or isinstance(response, StreamRelay) or response.status_code == 499:
        return response
    answer = json.loads(response.body)
    if response.status_code != 200:  # the replica refused the request: said in the dialect's words
        error = answer["error"]
        raise GatewayError(
            response.status_code, error.get("message", ""), param=error.get("param"), code=error.get("code")
        )
    body = json.dumps(await dialect.answer(gw, flight.grant, answer)).encode()
    return Response(body, headers=headers, media_type="application/json")


def _check_images(model: ModelRoute, checked: CheckedBody) -> None:
    """Images only for a vision model, and within its limits: refused here, before routing."""
    try:
        model.image_rules.check(checked.image_params, checked.image_sizes)
    except ProtocolError as refusal:
        raise bad_request(refusal.message, param=refusal.param, code=refusal.code) from None


def _invalid(error: BodyError) -> GatewayError:
    return GatewayError(error.status, error.message, param=error.param, code=error.code)


def _admitted(admission: Admission) -> Admission:
    """`admission`, or the 429 that says which limit refused it."""
    if not admission.allowed:
        which = admission.reason.replace("_", " ").replace("rpm", "requests per minute")
        raise GatewayError(
            429,
            f"Rate limit reached ({which}: {admission.limit}); retry after the retry-after header's seconds.",
            type="requests",
            code="rate_limit_exceeded",
            headers=admission.headers(),
        )
    return admission


async def _release_admitted(gw: Gateway, grant: KeyGrant, request_id: str) -> None:
    try:
        await gw.shared.finish(request_id, grant=grant)
    except Exception:  # its entries expire with the hold lifetime; the answer goes out regardless
        logger.warning("could not clear request %s from the in-flight sets", request_id, exc_info=True)


async def _unless_client_leaves(
    gw: Gateway,
    request: Request,
    flight: Flight,
    replicas: tuple[ReplicaRoute, ...],
    *,
    stream: bool,
    work: Coroutine[Any, Any, Any],
) -> Any:
    """`work`'s response (a whole answer, or a stream from its first token on), unless the client
    leaves first: then the work is cancelled, which closes the replica's connection (the replica
    aborts the request on its side), and the flight ends with its slots freed.

    How a request whose client left is billed follows one rule for both kinds: charged as
    cancelled once the replica generated its first token, released unbilled before. A stream's
    first token passes through the gateway, so before it is relayed (here) nothing is billed.
    A whole answer's tokens do not: the replica records which requests produced a first token
    and the gateway asks it (`_replica_started`). Releasing every abandoned whole answer would
    let a client run long generations for free by leaving just before their end; billing every
    one would bill requests that never left the queue. A replica that cannot answer the
    question releases the request (its failure, not the client's)."""
    result = await _client_present(request, work)
    if result is not _GONE:
        return result
    started = False
    replica = next((r for r in replicas if r.replica_id == flight.replica_id), None)
    if not stream and replica is not None:
        started = await _replica_started(gw, replica, flight)
    if not flight.settled:
        await flight.end(CANCELLED if started else None)
    return Response(status_code=499)  # nobody reads it: the client is gone


_GONE = object()


async def _client_present(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """`work`'s result, or _GONE if the client left first (then `work` is cancelled)."""
    work_task = asyncio.ensure_future(work)
    client_gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, client_gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        client_gone.cancel()
        if not work_task.done():
            work_task.cancel()
            await asyncio.wait({work_task})
    if work_task in done or not work_task.cancelled():  # the work finished first (or anyway)
        return work_task.result()
    return _GONE


async def _replica_started(gw: Gateway, replica: ReplicaRoute, flight: Flight) -> bool:
    """Whether the replica generated a first token for this request (it keeps recent ones); the
    prompt tokens it says the request took, and its cached ones, go on the flight for its usage
    record, as a stream's headers do."""
    request_id = flight.request_id
    try:
        async with asyncio.timeout(_STARTED_QUERY_TIMEOUT_S):
            response = await gw.upstream.get(
                replica.endpoint_url, f"/requests/{request_id}", {"authorization": f"Bearer {gw.config.worker_token}"}
            )
            data = await response.read()
        if response.status == 200 and isinstance(answer := json.loads(data), dict):
            flight.took_prompt(str(answer.get("prompt_tokens")), str(answer.get("cached_prompt_tokens")))
            return answer.get("started") is True
    except (UpstreamError, TimeoutError, ValueError):
        pass
    logger.warning(
        "could not ask replica %s whether request %s had started; releasing it unbilled", replica.replica_id, request_id
    )
    return False


async def _model(gw: Gateway, grant: KeyGrant, name) -> ModelRoute:
    if not isinstance(name, str) or not name:
        raise bad_request("model: give the name of the model to use.", param="model")
    model = await gw.routing.model(name)
    if model is None:
        raise model_not_found(name)
    if not grant.allows(model.model_id):
        raise model_not_allowed(name)
    return model


async def _idempotent_replay(gw: Gateway, scope: str, fingerprint: str, request_id: str) -> Response | None:
    entry = await gw.shared.idempotency_begin(scope, fingerprint)
    if entry is None:
        return None
    if entry["fingerprint"] != fingerprint:
        raise bad_request(
            "This Idempotency-Key was already used with a different request.", code="idempotency_key_reused"
        )
    if entry["state"] != "done":
        raise GatewayError(
            409, "A request with this Idempotency-Key is still in progress.", code="idempotency_key_in_use"
        )
    return Response(
        entry["body"],
        status_code=entry["status"],
        media_type="application/json",
        headers={"x-request-id": request_id, "idempotent-replayed": "true"},
    )


async def _attempt(
    gw: Gateway,
    flight: Flight,
    replicas: tuple[ReplicaRoute, ...],
    first: ReplicaRoute,
    tried: set[int],
    path: str,
    body: bytes,
    key: str,
) -> tuple[ReplicaRoute, UpstreamResponse]:
    """Send to `first`, or on a retry to the best replica not tried yet; returns once the
    response's status line has arrived."""
    if tried:
        candidates = [replica for replica in replicas if replica.replica_id not in tried]
        affinity = affinity_choice(key, candidates)
        replica = await gw.shared.pick(candidates, flight.request_id, affinity, flight.routed_tokens)
    else:
        replica = first  # picked together with admission
    flight.replica_id = replica.replica_id
    tried.add(replica.replica_id)
    response = await gw.upstream.post(
        replica.endpoint_url,
        path,
        body,
        {
            "authorization": f"Bearer {gw.config.worker_token}",
            "content-type": "application/json",
            "x-request-id": flight.request_id,
            **prefix_key_header(key),
            **tenancy_headers(
                tenant_id=flight.grant.tenant_id,
                weight=flight.grant.fair_share_weight,
                batch=flight.grant.batch_priority,
            ),
        },
    )
    if response.status not in (200, 400):
        # 5xx: loading, draining, broken; any other: not the request's fault either (a 400 is
        # the replica refusing the request itself), so not the client's to see.
        response.discard()
        raise ReplicaFailed(f"the replica answered {response.status}")
    return replica, response


def _replica_json(status: int, data: bytes) -> dict:
    """A replica's whole answer (200) or refusal (400, in OpenAI's error shape) as JSON;
    ReplicaFailed for anything else it sent."""
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict) or (status == 400 and not isinstance(answer.get("error"), dict)):
        raise ReplicaFailed(f"the replica's {status} answer is not what it sends: {data[:200]!r}")
    return answer


async def _failed_attempt(gw: Gateway, flight: Flight, why: BaseException) -> None:
    # The detail is for the operator: the client is told only that a replica failed.
    logger.warning(
        "request %s: replica %s failed: %s",
        flight.request_id,
        flight.replica_id,
        "no answer within the request's time limit" if isinstance(why, TimeoutError) else why,
    )
    await gw.shared.finish(flight.request_id, replica_id=flight.replica_id, replica_failed=True)
    flight.replica_id = None


def _deadline(gw: Gateway, flight: Flight) -> float:
    loop = asyncio.get_running_loop()
    return loop.time() + gw.config.request_timeout_s - (time.monotonic() - flight.started)


def _no_replica(gw: Gateway, flight: Flight, tried: bool) -> GatewayError:
    why = "the replicas tried failed" if tried else "none is ready"
    return unavailable(
        f"No replica of {flight.model.public_name!r} could serve the request ({why}; request id "
        f"{flight.request_id}); try again shortly.",
        gw.config.retry_after_s,
        code="replica_unavailable",
    )


async def _complete(
    gw: Gateway,
    flight: Flight,
    replicas,
    first: ReplicaRoute,
    path: str,
    body: bytes,
    key: str,
    headers: dict[str, str],
) -> Response:
    tried: set[int] = set()
    while len(tried) < min(_ATTEMPTS, len(replicas)):
        try:
            async with asyncio.timeout_at(_deadline(gw, flight)):
                replica, response = await _attempt(gw, flight, replicas, first, tried, path, body, key)
                data = await response.read()
            payload = _replica_json(response.status, data)
        except (UpstreamError, ReplicaFailed) as exc:
            await _failed_attempt(gw, flight, exc)
            continue
        except TimeoutError as exc:
            await _failed_attempt(gw, flight, exc)
            raise GatewayError(
                504, "The request took too long and was stopped.", type="server_error", code="timeout"
            ) from None
        if response.status != 200:  # the replica refused the request itself (400): not billed
            await flight.end(None)
            return Response(data, status_code=response.status, headers=headers, media_type="application/json")
        usage = payload.get("usage") or {}
        await flight.release_served()
        flight.settle_soon(COMPLETED, dict(usage))
        usage["cost"] = float(flight.cost)
        payload["usage"], payload["model"] = usage, flight.model.public_name
        return Response(json.dumps(payload).encode(), headers=headers, media_type="application/json")
    error = _no_replica(gw, flight, bool(tried))
    await flight.end(FAILED if tried else None, error_code=error.code)
    raise error


async def _stream(
    gw: Gateway,
    flight: Flight,
    replicas,
    first: ReplicaRoute,
    path: str,
    body: bytes,
    key: str,
    headers: dict[str, str],
    *,
    chat: bool,
    include_usage: bool,
    translator: StreamTranslator | None = None,
) -> Response | StreamRelay:
    tried: set[int] = set()
    deadline = _deadline(gw, flight)
    while len(tried) < min(_ATTEMPTS, len(replicas)):
        buffered: list[bytes] = []
        events = None
        try:
            async with asyncio.timeout_at(deadline):
                replica, response = await _attempt(gw, flight, replicas, first, tried, path, body, key)
                if response.status != 200:
                    data = await response.read()
                    _replica_json(response.status, data)
                    await flight.end(None)
                    return Response(data, status_code=response.status, headers=headers, media_type="application/json")
                flight.took_prompt(
                    response.headers.get(PROMPT_TOKENS_HEADER), response.headers.get(CACHED_PROMPT_TOKENS_HEADER)
                )
                events = response.events()
                async for data in events:
                    buffered.append(data)
                    if is_first_token(data, chat):
                        break
                else:
                    raise ReplicaFailed("the stream ended before its first token")
        except (UpstreamError, ReplicaFailed, ValueError, TimeoutError) as exc:
            if events is not None:
                await events.aclose()  # closes the connection: the replica drops the request
            await _failed_attempt(gw, flight, exc)
            if isinstance(exc, TimeoutError):
                raise GatewayError(
                    504, "The request took too long and was stopped.", type="server_error", code="timeout"
                ) from None
            continue
        try:
            await flight.first_token()
        except asyncio.CancelledError:  # the client left (see _unless_client_leaves)
            await events.aclose()
            raise
        return StreamRelay(flight, events, buffered, headers, include_usage, deadline, translator)
    error = _no_replica(gw, flight, bool(tried))
    await flight.end(FAILED if tried else None, error_code=error.code)
    raise error
