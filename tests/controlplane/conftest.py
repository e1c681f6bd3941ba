import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # The production hasher is deliberately slow (about a second per hash here); tests that
    # create users would spend most of their time in it.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
