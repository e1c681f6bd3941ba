"""Weight staging on real files: the wanted list's head that fits the budget is read into the page
cache and reported; what leaves the list is let go; bad paths are skipped, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuworker.checkpoint_files import resident_bytes
from gpuworker.contract.tasks import StageWeights
from gpuworker.daemon.staging import WeightStager


def _checkpoint(root: Path, name: str, shard_bytes: list[int]) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    files = [f"model-{i + 1:05d}-of-{len(shard_bytes):05d}.safetensors" for i in range(len(shard_bytes))]
    for file, size in zip(files, shard_bytes):
        (directory / file).write_bytes(bytes(range(256)) * (size // 256))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"t{i}": file for i, file in enumerate(files)}})
    )
    return directory


@pytest.fixture
def root(tmp_path):
    return tmp_path / "models"


def _staged(stager: WeightStager) -> dict[str, tuple[int, str, float]]:
    return {m.path: (m.bytes, m.how, m.resident_fraction) for m in stager.report().models}


def test_stages_the_head_of_the_list_that_fits_and_lets_go_of_the_rest(root):
    big = _checkpoint(root, "big", [64 * 1024, 64 * 1024])
    small = _checkpoint(root, "small", [32 * 1024])
    other = _checkpoint(root, "other", [16 * 1024])
    stager = WeightStager(budget_bytes=100 * 1024, model_roots=(root,))
    stager.stage(StageWeights(model_paths=[str(big), str(small), str(other)]))
    stager.apply()
    # big (128 KiB) does not fit 100 KiB; small and other do, in the list's order.
    assert _staged(stager) == {str(small): (32 * 1024, "page_cache", 1.0), str(other): (16 * 1024, "page_cache", 1.0)}
    assert stager.report().budget_bytes == 100 * 1024
    assert resident_bytes(next(small.glob("*.safetensors"))) == 32 * 1024

    stager.stage(StageWeights(model_paths=[str(other)]))
    stager.apply()
    assert list(_staged(stager)) == [str(other)]


def test_paths_outside_the_roots_or_without_weights_are_skipped(root, tmp_path):
    good = _checkpoint(root, "good", [4096])
    outside = _checkpoint(tmp_path / "elsewhere", "m", [4096])
    empty = root / "empty"
    empty.mkdir()
    stager = WeightStager(budget_bytes=1 << 20, model_roots=(root,))
    stager.stage(StageWeights(model_paths=[str(outside), str(empty), str(root / "missing"), str(good)]))
    stager.apply()
    assert list(_staged(stager)) == [str(good)]


def test_a_zero_budget_stages_nothing(root):
    model = _checkpoint(root, "m", [4096])
    stager = WeightStager(budget_bytes=0, model_roots=(root,))
    stager.stage(StageWeights(model_paths=[str(model)]))
    stager.apply()
    assert stager.report().models == ()


def test_the_stager_thread_applies_a_new_list_by_itself(root):
    model = _checkpoint(root, "m", [4096])
    stager = WeightStager(budget_bytes=1 << 20, model_roots=(root,), refresh_s=60.0)
    stager.start()
    try:
        stager.stage(StageWeights(model_paths=[str(model)]))
        import time

        deadline = time.monotonic() + 60
        while not stager.report().models and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _staged(stager) == {str(model): (4096, "page_cache", 1.0)}
    finally:
        stager.close()


def test_a_negative_budget_is_refused(root):
    with pytest.raises(ValueError, match="staging budget"):
        WeightStager(budget_bytes=-1, model_roots=(root,))
