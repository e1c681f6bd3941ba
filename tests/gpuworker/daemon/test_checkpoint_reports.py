"""What the daemon reads from each checkpoint under its model roots, on tiny random checkpoints
built with transformers: the Hugging Face id it answers to (plain org/name folders and the hub
cache's current snapshot), architecture, kind, parameter count and context, or why not."""

import json
import os
import shutil
from pathlib import Path

import pytest

from gpuworker.daemon.checkpoint_reports import checkpoint_report, repo_id_for
from gpuworker.daemon.model_paths import scan_model_roots


def _copy(checkpoint: Path, to: Path) -> Path:
    shutil.copytree(checkpoint, to)
    return to


def _parameters(checkpoint: Path) -> int:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint).num_parameters()


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2"])
def test_a_checkpoint_is_read_as_transformers_sees_it(tmp_path, tiny_checkpoint, family):
    checkpoint = tiny_checkpoint(family)
    root = tmp_path / "models"
    path = _copy(checkpoint, root / "org" / "tiny")
    report = checkpoint_report(path, root=root)
    config = json.loads((checkpoint / "config.json").read_text())
    assert report.problem == ""
    assert (report.repo_id, report.architecture, report.family, report.kind) == (
        "org/tiny",
        config["architectures"][0],
        config["model_type"],
        "chat",
    )
    assert report.parameter_count == _parameters(checkpoint)
    assert report.context_length == config["max_position_embeddings"]


def test_the_hub_caches_current_snapshot_answers_to_the_repository_id(tmp_path, tiny_checkpoint):
    root = tmp_path / "hub"
    repo = root / "models--meta-llama--Tiny-Llama"
    current = _copy(tiny_checkpoint("llama"), repo / "snapshots" / "4e20de3")
    older = _copy(tiny_checkpoint("llama"), repo / "snapshots" / "1a2b3c4")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("4e20de3\n")
    scan = scan_model_roots([root])
    reports = dict(scan.checkpoints)
    assert reports[str(current)].repo_id == "meta-llama/Tiny-Llama"
    assert reports[str(older)].repo_id == ""
    # refs/main moves: the other snapshot answers now, without its files changing.
    (repo / "refs" / "main").write_text("1a2b3c4")
    reports = dict(scan_model_roots([root]).checkpoints)
    assert reports[str(older)].repo_id == "meta-llama/Tiny-Llama" and reports[str(current)].repo_id == ""


def test_a_lone_snapshot_without_refs_is_current(tmp_path):
    root = tmp_path / "hub"
    snapshot = root / "models--org--name" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert repo_id_for(snapshot, root) == "org/name"
    assert repo_id_for(root / "name", root) == "name"
    assert repo_id_for(root / "a" / "b" / "c", root) == ""
    assert repo_id_for(tmp_path / "elsewhere", root) == ""


def test_an_unsupported_architecture_says_what_is_served(tmp_path):
    path = tmp_path / "models" / "gpt2"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    report = checkpoint_report(path, root=tmp_path / "models")
    assert report.repo_id == "gpt2" and report.family == "gpt2" and report.architecture == ""
    assert "unsupported architecture ['GPT2LMHeadModel']" in report.problem and "LlamaForCausalLM" in report.problem


@pytest.mark.parametrize(
    ("write", "problem"),
    [
        (lambda p: (p / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda p: (p / "config.json").write_text(json.dumps({"model_type": "llama"})), "no weights found"),
    ],
)
def test_a_broken_checkpoint_is_reported_with_why(tmp_path, write, problem):
    path = tmp_path / "broken"
    path.mkdir()
    write(path)
    report = checkpoint_report(path, root=tmp_path)
    assert problem in report.problem and report.parameter_count is None


def test_a_changed_config_is_read_again(tmp_path, tiny_checkpoint):
    path = _copy(tiny_checkpoint("llama"), tmp_path / "m")
    assert checkpoint_report(path, root=tmp_path).context_length != 333
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 333}))
    stat = (path / "config.json").stat()
    os.utime(path / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert checkpoint_report(path, root=tmp_path).context_length == 333


def test_the_scan_carries_the_reports_through_the_contract(tmp_path, tiny_checkpoint):
    from gpuworker.contract.heartbeat import parse_registration

    root = tmp_path / "models"
    path = _copy(tiny_checkpoint("llama"), root / "org" / "tiny")
    scan = scan_model_roots([root])
    body = {
        "name": "w",
        "advertise_host": "127.0.0.1",
        "device": "cpu",
        "gpus": [],
        "cpu": {"memory_total_bytes": 1, "cores": 1},
        "models": scan.to_json(),
    }
    parsed = parse_registration(json.loads(json.dumps(body))).models
    assert parsed == scan and dict(parsed.checkpoints)[str(path)].repo_id == "org/tiny"
