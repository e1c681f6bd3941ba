"""Where a conversation's KV lives, as the gateway and the replicas name it: the digest of a
request's affinity key (controlplane/gateway/replica_choice.py) travels to the replica in a header;
the replica reports, in its heartbeat figures, the digests whose prompt blocks its KV tiers still
hold, and the gateway sends that conversation's next turn to such a replica."""

from __future__ import annotations

import hashlib
import re

PREFIX_KEY_HEADER = "x-prefix-key"
# Hex digits of a digest: 64 bits, so distinct conversations practically never share one.
DIGEST_CHARS = 16
# A replica reports at most this many (its most recent): ~4 KB a heartbeat.
MAX_REPORTED_PREFIX_KEYS = 256


def prefix_key_digest(key: str) -> str:
    """The digest of a non-empty affinity key."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=DIGEST_CHARS // 2).hexdigest()


_DIGEST = re.compile(f"[0-9a-f]{{{DIGEST_CHARS}}}")


def is_prefix_key_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None
