"""API key format: `sk-` plus a random secret; only its hash and a short visible prefix are kept."""

from controlplane.tokens import new_secret_token, secret_hash

KEY_SCHEME = "sk-"
# "sk-" plus eight characters: enough to tell keys apart in a list, far too little to guess the rest.
VISIBLE_PREFIX_LENGTH = len(KEY_SCHEME) + 8


def generate_api_key() -> str:
    return KEY_SCHEME + new_secret_token()


def hash_api_key(plaintext: str) -> str:
    return secret_hash(plaintext)


def visible_prefix(plaintext: str) -> str:
    return plaintext[:VISIBLE_PREFIX_LENGTH]
