"""Bearer secrets (API keys, worker tokens): 256 random bits, stored only as a SHA-256 digest.

A fast hash is right here, unlike for passwords: the secret is random and long, so there is
nothing to guess, and a fast hash is what lets a caller be found with one indexed lookup.
"""

import hashlib
import os
import secrets
import tempfile


def new_secret_token() -> str:
    return secrets.token_urlsafe(32)


def secret_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def read_or_create_secret_file(path) -> str:
    """The secret kept in `path`, created (random, mode 0600) if missing.

    Several processes may start at once and race to create it: each writes its own candidate to
    a private temporary file and links it into place, which succeeds for exactly one of them; the
    rest read the winner's, so every process ends up with the same secret.
    """
    if not os.path.exists(path):
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, candidate = tempfile.mkstemp(dir=directory, prefix=".secret-")  # created 0600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(new_secret_token() + "\n")
            try:
                os.link(candidate, path)
            except FileExistsError:
                pass
        finally:
            os.unlink(candidate)
    with open(path) as handle:
        secret = handle.read().strip()
    if not secret:
        raise ValueError(f"{path} is empty; delete it to have a new secret generated.")
    return secret
