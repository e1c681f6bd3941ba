"""Adding a model from its checkpoint: a real worker daemon's agent registers with the control plane
(Django's live server) and reports what it read under its model root; the operator names the
checkpoint by its Hugging Face id, the add form comes back filled, and saving it adds the model."""

import html
import json
import re
import shutil

import pytest
from django.urls import reverse

from controlplane.audit.models import AuditEntry
from controlplane.catalog.models import Model
from controlplane.fleet.models import Worker
from tests.controlplane.dashboard.ops_support import cpu_agent, make_user
from tests.controlplane.factories import PriceTierFactory
from tests.gpuworker.checkpoints import make_checkpoint

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def registered_worker(tmp_path, live_server, settings):
    """A daemon's agent with a Hugging Face cache as its model root, registered over HTTP."""
    repo = tmp_path / "hub" / "models--acme--tiny-chat"
    snapshot = shutil.copytree(make_checkpoint(tmp_path / "build", "llama"), repo / "snapshots" / "f00d")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("f00d")
    agent = cpu_agent(
        control_url=live_server.url,
        token=settings.FLEET_WORKER_TOKEN,
        name="inspect-test",
        model_root=tmp_path / "hub",
        state_dir=tmp_path / "state",
    )
    try:
        agent._register()
        yield Worker.objects.get(name="inspect-test"), snapshot
    finally:
        agent._control.close()
        agent.probe.close()


def _input_value(page: str, name: str) -> str:
    tag = re.search(rf'<input[^>]*name="{name}"[^>]*>', page).group(0)
    return html.unescape(re.search(r'value="([^"]*)"', tag).group(1))


def _selected(page: str, name: str) -> str:
    select = page[page.index(f'name="{name}"') :]
    return re.search(r'<option value="([^"]*)"[^>]*selected', select).group(1)


def test_a_model_is_added_from_its_hugging_face_id(client, registered_worker):
    import transformers

    worker, snapshot = registered_worker
    operator = make_user("operator")
    client.force_login(operator)
    page = client.get(reverse("dashboard:catalog_add"), {"checkpoint": "acme/tiny-chat"}).content.decode()
    parameters = transformers.AutoModelForCausalLM.from_pretrained(snapshot).num_parameters()
    context = json.loads((snapshot / "config.json").read_text())["max_position_embeddings"]
    assert 'data-testid="checkpoint-facts"' in page and "inspect-test read LlamaForCausalLM" in page
    assert _input_value(page, "public_name") == "acme/tiny-chat"
    assert _input_value(page, "weights_path") == str(snapshot)
    assert _input_value(page, "family") == "llama" and _selected(page, "kind") == "chat"
    assert int(_input_value(page, "parameter_count")) == parameters
    assert int(_input_value(page, "context_length")) == context
    assert int(_input_value(page, "gpu_memory_bytes")) > 0

    form = {
        name: _input_value(page, name)
        for name in ("public_name", "family", "weights_path", "parameter_count", "context_length", "gpu_memory_bytes")
    }
    response = client.post(
        reverse("dashboard:catalog_add") + "?checkpoint=acme/tiny-chat",
        {
            **form,
            "kind": "chat",
            "quantization": "",
            "tensor_parallel_size": "1",
            "price_tier": str(PriceTierFactory().pk),
            "enabled": "on",
            "check_workers": [str(worker.pk)],
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    model = Model.objects.get(public_name="acme/tiny-chat")
    assert (model.weights_path, model.parameter_count, model.context_length) == (str(snapshot), parameters, context)
    assert AuditEntry.objects.get(action="model.create").actor == operator


def test_a_checkpoint_not_under_the_roots_is_refused_beside_the_field(client, registered_worker):
    client.force_login(make_user("operator"))
    page = client.get(reverse("dashboard:catalog_add"), {"checkpoint": "acme/other"}).content.decode()
    start = page.index('id="errors-checkpoint"')
    assert "No online worker has acme/other under its model roots" in page[start : page.index("</div>", start)]
    assert 'data-testid="checkpoint-facts"' not in page and _input_value(page, "checkpoint") == "acme/other"


def test_with_no_worker_online_the_reason_is_given(client, registered_worker):
    worker, _ = registered_worker
    Worker.objects.filter(pk=worker.pk).update(state=Worker.State.LOST)
    client.force_login(make_user("operator"))
    page = client.get(reverse("dashboard:catalog_add"), {"checkpoint": "acme/tiny-chat"}).content.decode()
    assert "No worker is online to read the checkpoint" in page


def test_the_add_page_offers_to_read_a_checkpoint(client):
    client.force_login(make_user("operator"))
    page = client.get(reverse("dashboard:catalog_add")).content.decode()
    assert 'data-testid="checkpoint-form"' in page and 'name="checkpoint"' in page
