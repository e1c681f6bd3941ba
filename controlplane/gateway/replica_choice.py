"""The router's replica choice as pure functions (standard library and the worker contract only), so the gateway and the
fleet simulator (bench/fleet_sim.py) run the same rule. The Redis Lua script in scripts.py
(_PICK) is the one other copy, because Redis runs it atomically; test_shared.py checks both agree.
"""

import hashlib
import json
from collections.abc import Sequence
from typing import Protocol

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


def predicted_wait_s(figures: dict, routed_tokens: int = 0, since_report_s: float = 0.0) -> float:
    """Seconds a request arriving now at a replica would wait before its prefill, from the
    replica's own load report: the prompt tokens queued ahead of it (`waiting_tokens`, plus
    `routed_tokens`: those the gateway sent it since that report, which the report cannot show),
    less what the replica has prefilled in the `since_report_s` seconds since the report, over its
    recent prefill rate (`prefill_tokens_per_s`). 0 without a queue or a measured rate: a replica
    that has not prefilled lately gives no evidence that it is slow.

    The drain is taken off the reported queue and the routed work together, as one backlog: what
    was routed late in the interval is credited with prefill time from the report on, which
    predicts low only while the replica idled since its report (its next report corrects it)."""
    waiting, rate = figures.get("waiting_tokens"), figures.get("prefill_tokens_per_s")
    if not isinstance(waiting, int | float) or not isinstance(rate, int | float) or rate <= 0:
        return 0.0
    queued = max(waiting, 0) + routed_tokens - rate * max(since_report_s, 0.0)
    return queued / rate if queued > 0 else 0.0


# The gateway does not tokenize: a request's prompt tokens are guessed from its body's length at
# about four bytes a token (English text; a token-id prompt's digits and commas take more).
BODY_BYTES_PER_PROMPT_TOKEN = 4


def prompt_tokens_estimate(body_bytes: int) -> int:
    """The prompt tokens a request of `body_bytes` bytes brings to its replica's queue."""
    return max(1, body_bytes // BODY_BYTES_PER_PROMPT_TOKEN)
