"""A checkpoint named by path or Hugging Face id, found in what registered workers read under their
model roots (real scans of tiny random checkpoints, registered through the fleet's service), and
each refusal saying what to do."""

import json
import shutil
import uuid

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.catalog.checkpoints import checkpoint_lookup
from controlplane.catalog.services import estimate_gpu_memory_bytes
from controlplane.fleet.services.workers import worker_register
from gpuworker.contract.heartbeat import parse_registration
from gpuworker.daemon.model_paths import scan_model_roots
from tests.gpuworker.checkpoints import make_checkpoint

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _worker(roots, *, with_reports=True):
    scan = scan_model_roots(roots).to_json()
    if not with_reports:
        scan.pop("checkpoints", None)
    return worker_register(
        registration=parse_registration(
            {
                "name": f"w-{uuid.uuid4().hex[:8]}",
                "advertise_host": "10.0.0.5",
                "device": "cpu",
                "gpus": [],
                "cpu": {"memory_total_bytes": 1 << 34, "cores": 8},
                "models": scan,
            }
        ),
        now=timezone.now(),
    )


def _hub(tmp_path, tiny):
    """A Hugging Face cache holding org/tiny at revision abc123, the one refs/main names."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = shutil.copytree(tiny, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    return tmp_path / "hub", snapshot


def test_a_hugging_face_id_is_found_in_the_hub_cache_and_read(tmp_path, tiny):
    import transformers

    root, snapshot = _hub(tmp_path, tiny)
    worker = _worker([root])
    facts = checkpoint_lookup(reference="org/tiny", workers=[worker])
    config = json.loads((tiny / "config.json").read_text())
    parameters = transformers.AutoModelForCausalLM.from_pretrained(tiny).num_parameters()
    assert (facts.worker_name, facts.weights_path, facts.repo_id) == (worker.name, str(snapshot), "org/tiny")
    assert (facts.architecture, facts.family, facts.kind) == ("LlamaForCausalLM", "llama", "chat")
    assert facts.parameter_count == parameters and facts.context_length == config["max_position_embeddings"]
    assert facts.quantization == ""
    assert facts.gpu_memory_bytes == estimate_gpu_memory_bytes(parameter_count=parameters, quantization="")
    assert facts.model_initial()["public_name"] == "org/tiny"


def test_a_path_and_a_plain_org_name_folder_are_found(tmp_path, tiny):
    path = shutil.copytree(tiny, tmp_path / "models" / "acme" / "chat-1")
    worker = _worker([tmp_path / "models"])
    by_path = checkpoint_lookup(reference=f"{path}/", workers=[worker])
    by_id = checkpoint_lookup(reference="acme/chat-1", workers=[worker])
    assert by_path == by_id and by_path.weights_path == str(path)


def test_the_worker_that_can_serve_it_is_preferred(tmp_path, tiny):
    broken = tmp_path / "a" / "org" / "tiny"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    first = _worker([tmp_path / "a"])
    shutil.copytree(tiny, tmp_path / "b" / "org" / "tiny")
    second = _worker([tmp_path / "b"])
    assert checkpoint_lookup(reference="org/tiny", workers=[first, second]).worker_name == second.name
    with pytest.raises(ValidationError, match="cannot serve the checkpoint at .*unsupported architecture"):
        checkpoint_lookup(reference="org/tiny", workers=[first])


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("", "Name a checkpoint"),
        ("org/missing", r"No online worker has org/missing under its model roots \(.*models--org--missing/snapshots"),
        ("/elsewhere/model", "lies outside"),
        ("not a path!", "neither an absolute path nor a Hugging Face id"),
    ],
)
def test_refusals_say_why(tmp_path, tiny, reference, message):
    root, _ = _hub(tmp_path, tiny)
    with pytest.raises(ValidationError, match=message) as error:
        checkpoint_lookup(reference=reference, workers=[_worker([root])])
    assert list(error.value.message_dict) == ["checkpoint"]


def test_no_worker_online_is_said(tiny):
    with pytest.raises(ValidationError, match="No worker is online to read the checkpoint"):
        checkpoint_lookup(reference="org/tiny", workers=[])


def test_a_worker_that_reports_paths_only_says_to_enter_the_figures(tmp_path, tiny):
    path = shutil.copytree(tiny, tmp_path / "models" / "m")
    worker = _worker([tmp_path / "models"], with_reports=False)
    with pytest.raises(ValidationError, match="did not say what it holds"):
        checkpoint_lookup(reference=str(path), workers=[worker])
