"""The router's replica choice as pure functions (standard library and the worker contract only), so the gateway and the
fleet simulator (bench/fleet_sim.py) run the same rule. The Redis Lua script in scripts.py
(_PICK) is the one other copy, because Redis runs it atomically; test_shared.py checks both agree.
"""

import hashlib
import json
from collections.abc import Sequence
from typing import Protocol

from gpuworker.contract.image_tokens import (
    FIXED_IMAGE_TOKENS,
    IMAGE_PIXELS_PER_TOKEN,
    MAX_IMAGE_TOKENS,
    image_tokens,
)
from gpuworker.contract.prefix_keys import PREFIX_KEY_HEADER, prefix_key_digest


class HasReplicaId(Protocol):
    replica_id: int


def affinity_key(body: dict, chat: bool, chars: int) -> str:
    """What a request's replica is chosen by, to hit its prefix cache; "" when the rendered prompt
    is shorter than `chars` (too short to be worth pinning).

    Completions: the prompt's first `chars` characters. Chat: a short digest of the leading system
    message(s), so that a long system prompt shared by a model's conversations neither fills the key
    nor makes them all one key, then the conversation's opening (its messages from the first
    non-system one up to the first assistant reply, which every later turn resends unchanged) up to
    `chars` characters: a conversation's turns share a key and different conversations spread.
    Whether it is worth pinning is judged on the whole rendered length, system prompt included."""
    if not chat:
        prompt = body.get("prompt")
        # A list's first `chars` items already render to at least `chars` characters: the key is
        # the same as from the whole list, which may hold millions of token ids.
        text = prompt if isinstance(prompt, str) else json.dumps(prompt[:chars] if isinstance(prompt, list) else prompt)
        return text[:chars] if len(text) >= chars else ""
    messages = [m for m in body.get("messages") or () if isinstance(m, dict)]
    rendered = [f"{m.get('role')}:{_content(m.get('content'))}\n" for m in messages]
    if sum(map(len, rendered)) < chars:
        return ""
    system = 0
    while system < len(messages) and messages[system].get("role") in _SYSTEM_ROLES:
        system += 1
    opening, length = [], 0
    for message, text in zip(messages[system:], rendered[system:]):
        if (message.get("role") == "assistant" and opening) or length >= chars:
            break
        opening.append(text)
        length += len(text)
    key = "".join(opening)[:chars]
    if system:
        digest = hashlib.blake2b("".join(rendered[:system]).encode("utf-8", "surrogatepass"), digest_size=8)
        key = f"system#{digest.hexdigest()}\n{key}"
    return key


_SYSTEM_ROLES = ("system", "developer")  # OpenAI's instruction roles


def _content(content: object) -> str:
    return content if isinstance(content, str) else json.dumps(content)


def affinity_choice(key: str, candidates: Sequence[HasReplicaId]) -> int | None:
    """The index of the replica a request's affinity key (affinity_key) belongs to, or None without
    a key or a choice: among the replicas that report holding the key's conversation in their KV
    tiers (a `prefix_keys` set of prefix_key_digest values) if any does, else among all, by
    rendezvous hashing (stable while replicas come and go, and the same in every gateway process)."""
    if not key or len(candidates) < 2:
        return None
    reported = prefix_key_digest(key)
    holders = [i for i, replica in enumerate(candidates) if reported in getattr(replica, "prefix_keys", ())]
    indexes = holders or range(len(candidates))
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    scores = {i: hashlib.blake2b(b"%d" % candidates[i].replica_id, key=digest, digest_size=8).digest() for i in indexes}
    return max(indexes, key=scores.__getitem__)


def prefix_key_header(key: str) -> dict[str, str]:
    """The header naming a request's conversation to its replica, which reports where its KV stays."""
    return {PREFIX_KEY_HEADER: prefix_key_digest(key)} if key else {}


def least_outstanding(counts: Sequence[int], up: Sequence[bool], affinity: int | None, max_extra: int) -> int:
    """The index to send a request to: the replica with the fewest outstanding requests among those
    up (all of them if none is), or the affinity replica while it has at most max_extra more."""
    indexes = range(len(counts))
    # Replicas that failed recently are passed over; if all did, the least busy is tried anyway.
    best = min((i for i in indexes if up[i]), key=counts.__getitem__, default=None)
    if best is None:
        best = min(indexes, key=counts.__getitem__)
    if affinity is not None and (up[affinity] or not any(up)) and counts[affinity] <= counts[best] + max_extra:
        best = affinity
    return best


def predicted_wait_s(figures: dict, routed: Sequence[tuple[float, int]] = (), since_report_s: float = 0.0) -> float:
    """Seconds a request arriving now at a replica would wait before its prefill, from the
    replica's own load report: the prompt tokens queued ahead of it (`waiting_tokens`, plus
    `routed`: the requests the gateway sent it since that report, which the report cannot show, as
    (seconds after the report, prompt tokens) in the order they were sent), less what the replica
    has prefilled in the `since_report_s` seconds since the report, over its recent prefill rate
    (`prefill_tokens_per_s`). 0 without a queue or a measured rate: a replica that has not
    prefilled lately gives no evidence that it is slow.

    The queue is followed from the report on (`queued_tokens`): the replica drains only work it
    has, so time it spent idle is not credited against work routed to it later."""
    waiting, rate = figures.get("waiting_tokens"), figures.get("prefill_tokens_per_s")
    if not isinstance(waiting, int | float) or not isinstance(rate, int | float) or rate <= 0:
        return 0.0
    return queued_tokens(max(waiting, 0), rate, routed, since_report_s) / rate


def queued_tokens(waiting: float, rate: float, routed: Sequence[tuple[float, int]], now: float) -> float:
    """A replica's queue of prompt tokens at `now` (seconds after its load report): `waiting` at the
    report, each request of `routed` ((seconds after the report, prompt tokens), in the order sent)
    joining it when sent, drained at `rate` tokens a second while there is something to drain and
    never below empty. Times before the report (clocks apart) count as the report's."""
    queued, at = waiting, 0.0
    for sent, tokens in routed:
        sent = max(sent, at)
        queued = max(0.0, queued - rate * (sent - at)) + tokens
        at = sent
    return max(0.0, queued - rate * max(now - at, 0.0))


# The gateway does not tokenize: a request's text is guessed from its body's length at about four
# bytes a token (English text; a token-id prompt's digits and commas take more).
BODY_BYTES_PER_PROMPT_TOKEN = 4


def image_tokens_estimate(
    detail: str, max_image_pixels: int, low_detail_pixels: int, size: tuple[int, int] | None = None, family: str = ""
) -> int:
    """The prompt tokens one image part is counted as before the replica decodes it: what the
    model's processor makes of an image of `size` (width, height, read from its header; for
    `detail` "low", scaled down to `low_detail_pixels` first: image_tokens.image_tokens), or,
    when its size is not known (an http(s) URL, a header not found), the most it can make of one
    of the catalog's `max_image_pixels` (MAX_IMAGE_TOKENS at most; `low_detail_pixels` for "low").
    A `family` whose encoder makes a fixed number of tokens an image counts that, whatever the size."""
    if size is not None or family in FIXED_IMAGE_TOKENS:
        return image_tokens(*(size or (1, 1)), detail, low_detail_pixels, family)
    pixels = min(max_image_pixels, low_detail_pixels) if detail == "low" else max_image_pixels
    return min(MAX_IMAGE_TOKENS, -(-pixels // IMAGE_PIXELS_PER_TOKEN))


def prompt_tokens_estimate(text_bytes: int, image_tokens: int = 0) -> int:
    """The prompt tokens a request brings to its replica's queue: its body's bytes other than its
    images' URLs (`text_bytes`) at BODY_BYTES_PER_PROMPT_TOKEN each, and its images'
    (`image_tokens`, from image_tokens_estimate): a base64 image's bytes are not text."""
    return max(1, text_bytes // BODY_BYTES_PER_PROMPT_TOKEN + image_tokens)
