import hashlib

from controlplane.accounts.keys import (
    KEY_SCHEME,
    VISIBLE_PREFIX_LENGTH,
    generate_api_key,
    hash_api_key,
    visible_prefix,
)


def test_generated_keys_have_the_sk_scheme_and_are_unique():
    keys = {generate_api_key() for _ in range(200)}
    assert len(keys) == 200
    assert all(key.startswith(KEY_SCHEME) and len(key) >= 40 for key in keys)


def test_hash_is_sha256_hex_of_the_whole_key():
    key = generate_api_key()
    assert hash_api_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert hash_api_key(key) != hash_api_key(key + "x")


def test_visible_prefix_is_short_and_starts_the_key():
    key = generate_api_key()
    assert visible_prefix(key) == key[:VISIBLE_PREFIX_LENGTH]
    assert len(visible_prefix(key)) == len(KEY_SCHEME) + 8
