"""Onboarding against a running gateway and CPU replicas: the Python sample shown with a new key
runs as written and gets an answer; an edit on the keys page reaches the gateway at the next
request while the key itself stays the same."""

import html
import os
import subprocess
import sys

import openai
import pytest
from django.test import Client
from django.urls import reverse

from controlplane.accounts.models import ApiKey, User
from tests.controlplane.factories import ModelFactory, UserFactory
from tests.controlplane.gateway.conftest import make_world, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _between(page: str, marker: str) -> str:
    start = page.index(marker)
    return html.unescape(page[page.index(">", start) + 1 : page.index("</code>", start)])


def test_the_first_request_runs_and_a_key_edit_reaches_the_gateway(gateway, replicas):
    world = make_world(gateway, replicas)
    client = Client()
    client.force_login(UserFactory(role=User.Role.TENANT_MEMBER, tenant=world.tenant))
    page = client.post(reverse("dashboard:keys"), {"name": "first"}).content.decode()
    plaintext = _between(page, 'id="key-plaintext"')
    python = _between(page, 'id="quickstart-python"')
    assert plaintext in python and world.model.public_name in python
    # As a tenant would run it: against this server's /v1 (the test client's host is testserver).
    script = python.replace("http://testserver/v1", f"{world.base_url}/v1")
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "OPENAI_API_KEY": plaintext},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]

    api = world.client(api_key=plaintext)
    api_key = ApiKey.objects.get(tenant=world.tenant, name="first")
    other = ModelFactory(public_name="other-model")
    secret = (api_key.key_hash, api_key.prefix)
    response = client.post(
        reverse("dashboard:key_edit", args=[api_key.pk]), {"name": "first", "allowed_models": [other.public_name]}
    )
    assert response.status_code == 302

    def refused() -> bool:
        try:
            api.chat.completions.create(
                model=world.model.public_name, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
            )
        except openai.PermissionDeniedError:
            return True
        return False

    wait_until(refused, 10, "the gateway to apply the key's new models")
    api_key.refresh_from_db()
    assert (api_key.key_hash, api_key.prefix) == secret
    assert api.models.list() is not None  # the same key still authenticates
    world.settled()
