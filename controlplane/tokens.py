"""Bearer secrets (API keys, worker tokens): 256 random bits, stored only as a SHA-256 digest.

A fast hash is right here, unlike for passwords: the secret is random and long, so there is
nothing to guess, and a fast hash is what lets a caller be found with one indexed lookup.
"""

import hashlib
import secrets


def new_secret_token() -> str:
    return secrets.token_urlsafe(32)


def secret_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()
