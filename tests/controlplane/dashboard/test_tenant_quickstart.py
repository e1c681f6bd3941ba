"""The Quickstart: the base URL and first requests for one of the tenant's keys, with its prefix
only; the whole key appears in the samples of the response that created it, and never again."""

import html
import shutil
import subprocess

import pytest
from django.urls import reverse

from controlplane.accounts.models import User
from controlplane.accounts.services import api_key_revoke
from controlplane.catalog.models import Model
from controlplane.dashboard.tenant.quickstart import quickstart_samples
from tests.controlplane.factories import ApiKeyFactory, ModelFactory, TenantFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def member(client):
    user = UserFactory(role=User.Role.TENANT_MEMBER, tenant=TenantFactory(name="Acme"))
    client.force_login(user)
    return user


def _samples(page: str) -> dict[str, str]:
    found = {}
    for language in ("shell", "python", "javascript"):
        start = page.index(f'id="quickstart-{language}"')
        found[language] = html.unescape(page[page.index(">", start) + 1 : page.index("</code>", start)])
    return found


def test_the_quickstart_is_in_the_tenants_navigation(client, member):
    page = client.get(reverse("dashboard:keys")).content.decode()
    assert f'href="{reverse("dashboard:quickstart")}"' in page


def test_the_samples_carry_the_base_url_the_prefix_and_a_model_the_key_may_call(client, member):
    ModelFactory(public_name="embed", kind=Model.Kind.EMBEDDING)
    ModelFactory(public_name="chat-a")
    allowed = ModelFactory(public_name="chat-b")
    api_key = ApiKeyFactory(tenant=member.tenant, name="ci", all_models=False)
    api_key.allowed_models.set([allowed])
    page = client.get(reverse("dashboard:quickstart")).content.decode()
    assert 'data-testid="quickstart-base-url">http://testserver/v1<' in page
    samples = _samples(page)
    assert api_key.plaintext not in page
    for code in samples.values():
        assert f"{api_key.prefix}…" in code and "chat-b" in code and "chat-a" not in code
    assert "curl http://testserver/v1/chat/completions" in samples["shell"]
    assert 'OpenAI(base_url="http://testserver/v1"' in samples["python"]
    assert 'import OpenAI from "openai"' in samples["javascript"]
    assert 'baseURL: "http://testserver/v1"' in samples["javascript"]


def test_the_samples_name_the_model_the_playground_offers_a_ready_one_first(client, member):
    from controlplane.fleet.models import Replica
    from tests.controlplane.factories import DeploymentFactory, ReplicaFactory, WorkerFactory

    ModelFactory(public_name="noise-first")  # added first, but nothing serves it
    ready = ModelFactory(public_name="served-chat")
    ReplicaFactory(deployment=DeploymentFactory(model=ready), worker=WorkerFactory(), state=Replica.State.READY)
    ApiKeyFactory(tenant=member.tenant, name="ci")
    samples = _samples(client.get(reverse("dashboard:quickstart")).content.decode())
    assert all("served-chat" in code and "noise-first" not in code for code in samples.values())


def test_a_key_is_chosen_among_the_tenants_usable_ones_only(client, member):
    first = ApiKeyFactory(tenant=member.tenant, name="first")
    newest = ApiKeyFactory(tenant=member.tenant, name="newest")
    revoked = api_key_revoke(api_key=ApiKeyFactory(tenant=member.tenant, name="gone"))
    other = ApiKeyFactory(tenant=TenantFactory(), name="theirs")
    page = client.get(reverse("dashboard:quickstart")).content.decode()
    assert f"{newest.prefix}…" in _samples(page)["python"]
    assert revoked.prefix not in page and "theirs" not in page
    chosen = client.get(reverse("dashboard:quickstart"), {"key": first.pk}).content.decode()
    assert f"{first.prefix}…" in _samples(chosen)["python"]
    # Another tenant's key id falls back to one's own newest key and reveals nothing.
    foreign = client.get(reverse("dashboard:quickstart"), {"key": other.pk}).content.decode()
    assert other.prefix not in foreign and f"{newest.prefix}…" in _samples(foreign)["python"]
    partial = client.get(reverse("dashboard:quickstart"), {"key": first.pk}, headers={"HX-Request": "true"})
    assert partial.content.decode().lstrip().startswith('<div id="quickstart-samples"')


def test_without_a_key_the_page_says_to_create_one(client, member):
    page = client.get(reverse("dashboard:quickstart")).content.decode()
    assert "You have no usable key yet" in page and reverse("dashboard:keys") in page
    assert "MODEL_NAME" in _samples(page)["python"]


def test_a_created_key_is_shown_with_its_first_requests_once(client, member):
    ModelFactory(public_name="chat-a")
    response = client.post(reverse("dashboard:keys"), {"name": "production"}, headers={"HX-Request": "true"})
    page = response.content.decode()
    start = page.index('id="key-plaintext"')
    plaintext = page[page.index(">", start) + 1 : page.index("</code>", start)]
    samples = _samples(page)
    assert all(plaintext in code and "chat-a" in code for code in samples.values())
    assert response["Cache-Control"] == "no-store"
    later = client.get(reverse("dashboard:quickstart")).content.decode()
    assert plaintext not in later and f"{plaintext[:8]}" in later


@pytest.mark.parametrize("role", [User.Role.OPERATOR, User.Role.ADMIN])
def test_the_quickstart_is_a_tenant_page(client, role):
    client.force_login(UserFactory(role=role, tenant=None))
    assert client.get(reverse("dashboard:quickstart")).status_code == 403


def test_samples_quote_what_a_shell_would_otherwise_read():
    shell = quickstart_samples(base_url="http://h/v1", key="sk-a'b", model="m")[0].code
    assert "export OPENAI_API_KEY='sk-a'\"'\"'b'" in shell


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_javascript_sample_is_a_valid_es_module(tmp_path):
    javascript = quickstart_samples(base_url="http://h/v1", key="sk-abc…", model="m")[2].code
    (tmp_path / "quickstart.mjs").write_text(javascript)
    check = subprocess.run(["node", "--check", str(tmp_path / "quickstart.mjs")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_python_sample_compiles():
    compile(quickstart_samples(base_url="http://h/v1", key="sk-abc…", model="m")[1].code, "quickstart.py", "exec")
