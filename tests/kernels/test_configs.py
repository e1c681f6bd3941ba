"""gpuworker.kernels.configs: the writer the sweeps call (--write-configs) and the loader the kernels
read through, on the CPU against a temporary folder; and the files that ship, each one readable by its
kernel."""

from __future__ import annotations

import json

import pytest
import torch

from gpuworker.kernels import configs
from gpuworker.kernels.attention import paged_decode
from gpuworker.kernels.linear import gemv
from gpuworker.kernels.moe import decode as moe_decode
from gpuworker.kernels.quant import block_fp8_matmul, int4_matmul
from gpuworker.kernels.sampling import sample

KEY = ("dtype", "n", "k")
# Every kernel with configs: its key and how a record's other fields become its config.
KERNELS = {
    "gemv": (gemv.TABLE_KEY, gemv._candidate),
    "block_fp8_matmul": (block_fp8_matmul.GEMM_TABLE_KEY, block_fp8_matmul.BlockFp8GemmConfig),
    "int4_gemv": (int4_matmul.GEMV_TABLE_KEY, int4_matmul.Int4GemvConfig),
    "int4_matmul": (int4_matmul.GEMM_TABLE_KEY, int4_matmul.Int4GemmConfig),
    "sample": (sample.TABLE_KEY, sample.SamplingConfig),
    "paged_decode": (paged_decode.TABLE_KEY, None),
    "moe_decode": (moe_decode.TABLE_KEY, None),
}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """An empty configs folder the loader reads, on a GPU called "Test GPU 80GB"."""
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(configs, "device_name", lambda device=None: "Test GPU 80GB")
    return tmp_path


def test_file_names_are_the_device_names_made_safe():
    assert configs.file_name("NVIDIA H200") == "NVIDIA_H200.json"
    assert configs.file_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3.json"
    assert configs.file_name(" NVIDIA A100-SXM4-40GB ") == "NVIDIA_A100-SXM4-40GB.json"
    assert configs.file_name("AMD Instinct MI300X / VF") == "AMD_Instinct_MI300X_VF.json"
    with pytest.raises(ValueError, match="letter or digit"):
        configs.file_name(" / ")


def test_what_the_writer_writes_the_loader_reads_back(folder):
    records = [
        {"dtype": "bfloat16", "n": 4096, "k": 4096, "config": "a", "note": "o_proj"},
        {"dtype": "bfloat16", "n": 128, "k": 2048, "config": "b"},
    ]
    path = configs.write("toy", KEY, records, device="Test GPU 80GB")
    assert path == folder / "toy" / "Test_GPU_80GB.json"
    data = json.loads(path.read_text())
    assert data["kernel"] == "toy" and data["device"] == "Test GPU 80GB" and data["key"] == list(KEY)
    assert [r["n"] for r in data["configs"]] == [128, 4096]  # sorted by key
    table = configs.table("toy", KEY)
    assert dict(table) == {("bfloat16", 4096, 4096): {"config": "a"}, ("bfloat16", 128, 2048): {"config": "b"}}
    assert configs.table("toy", KEY, build=lambda config: config.upper())[("bfloat16", 128, 2048)] == "B"
    with pytest.raises(TypeError):
        table[("bfloat16", 1, 1)] = {}  # read-only: one copy serves every caller


def test_a_write_merges_replaces_and_removes(folder):
    configs.write(
        "toy",
        KEY,
        [
            {"dtype": "bfloat16", "n": 1, "k": 1, "config": "a"},
            {"dtype": "bfloat16", "n": 2, "k": 2, "config": "b"},
            {"dtype": "float16", "n": 2, "k": 2, "config": "c"},
        ],
        device="Test GPU 80GB",
    )
    assert configs.table("toy", KEY)[("bfloat16", 2, 2)] == {"config": "b"}  # read, and cached
    configs.write(
        "toy",
        KEY,
        [{"dtype": "bfloat16", "n": 2, "k": 2, "config": "b2"}, {"dtype": "bfloat16", "n": 3, "k": 3, "config": "d"}],
        remove=[{"dtype": "float16", "n": 2, "k": 2}],
        device="Test GPU 80GB",
    )
    assert {index: record["config"] for index, record in configs.table("toy", KEY).items()} == {
        ("bfloat16", 1, 1): "a",
        ("bfloat16", 2, 2): "b2",
        ("bfloat16", 3, 3): "d",
    }
    assert not list(folder.glob("toy/.*")), "no temporary file left behind"


def test_another_device_or_kernel_reads_nothing(folder):
    configs.write("toy", KEY, [{"dtype": "bfloat16", "n": 1, "k": 1, "config": "a"}], device="Other GPU")
    assert configs.table("toy", KEY) == {}  # this GPU has no file
    assert configs.table("other", KEY) == {}


def _bad_file(folder, kernel: str, text: str) -> None:
    (folder / kernel).mkdir()
    (folder / kernel / "Test_GPU_80GB.json").write_text(text)


def test_a_bad_file_is_named(folder):
    configs.write("toy", KEY, [{"dtype": "bfloat16", "n": 1, "k": 1, "config": "a"}], device="Test GPU 80GB")
    with pytest.raises(ValueError, match="keyed by"):
        configs.table("toy", ("dtype", "n"))
    record = {"dtype": "bfloat16", "n": 1, "k": 1, "config": "a"}
    _bad_file(folder, "twice", json.dumps({"key": list(KEY), "configs": [record, record]}))
    with pytest.raises(ValueError, match="two records"):
        configs.table("twice", KEY)
    _bad_file(folder, "short", json.dumps({"key": list(KEY), "configs": [{"dtype": "bfloat16", "n": 1}]}))
    with pytest.raises(ValueError, match="key fields"):
        configs.table("short", KEY)
    _bad_file(folder, "broken", "{")
    with pytest.raises(ValueError, match="not valid JSON"):
        configs.table("broken", KEY)
    with pytest.raises(ValueError, match="key fields"):
        configs.write("toy", KEY, [{"dtype": "bfloat16", "n": 1}], device="Another GPU")


def test_buckets():
    assert configs.bucket(1, [1, 64, 512]) == 1
    assert configs.bucket(2, [512, 1, 64]) == 64
    assert configs.bucket(513, [1, 64, 512]) is None
    assert configs.bucket(3, []) is None


def test_a_cpu_device_is_the_interpreter_standing_in_for_its_gpu():
    assert configs.device_name("cpu") == configs.INTERPRETER_DEVICE
    if not torch.cuda.is_available():
        assert configs.device_name() == configs.INTERPRETER_DEVICE
    else:
        assert configs.device_name() == torch.cuda.get_device_name()


def test_every_shipped_file_is_its_kernels_and_builds(monkeypatch):
    files = sorted(configs.CONFIG_DIR.glob("*/*.json"))
    assert {path.parent.name for path in files} >= {"gemv", "int4_gemv", "int4_matmul", "sample", "paged_decode"}
    for path in files:
        data = json.loads(path.read_text())
        assert path.parent.name in KERNELS, f"{path}: no kernel reads configs/{path.parent.name}"
        key, build = KERNELS[path.parent.name]
        assert data["kernel"] == path.parent.name, path
        assert configs.file_name(data["device"]) == path.name, path
        assert tuple(data["key"]) == key, path
        monkeypatch.setattr(configs, "device_name", lambda device=None: data["device"])
        table = configs.table(data["kernel"], key, build=build)  # every record builds into its kernel's config
        assert len(table) == len(data["configs"]) > 0, path
        assert all(configs.NOTE in record for record in data["configs"]), f"{path}: a record without a note"
