"""Qwen2.5-VL's vision tower and multimodal rotary wait on the device nowhere: run on the meta
device (a stand-in for a GPU: no data, so a read of device values fails), a forward over N images
reads no device value on the host and copies from the host only without blocking, however many
images, windows and blocks it has."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpuworker.models.qwen2_5_vl.config import VisionLayout
from gpuworker.models.qwen2_5_vl.model import MultimodalRotary
from gpuworker.models.qwen2_5_vl.vision import VisionTransformer

LAYOUT = VisionLayout(
    depth=4,
    hidden_size=32,
    num_heads=2,
    intermediate_size=40,
    out_hidden_size=24,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=56,
    fullatt_block_indexes=(1, 3),
    in_channels=3,
    rope_theta=10000.0,
    image_token_id=5,
    vision_start_token_id=4,
    mrope_section=(2, 1, 1),
)
# Reads of device values on the host (item, tolist), and the ops whose output size depends on the
# values (the host waits for them): boolean masks, nonzero, unique.
READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2", "_unique", "item"}


class Syncs(TorchDispatchMode):
    """Counts, per op name, the ops that make the host wait for the device: value reads and blocking
    copies from the host to the device."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        on_device = any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        if (name in READS and on_device) or self._blocking_upload(name, args, kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **kwargs)

    @staticmethod
    def _blocking_upload(name: str, args, kwargs) -> bool:
        if name == "_to_copy":
            device = kwargs.get("device")
            source = args[0]
            return (source.device.type == "cpu" and device is not None and device.type != "cpu") and not kwargs.get(
                "non_blocking", False
            )
        if name == "copy_":
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            return src.device.type == "cpu" and dst.device.type != "cpu" and blocking
        return False


@pytest.mark.parametrize("grids", [[(1, 8, 8)], [(1, 8, 8), (1, 12, 6), (1, 4, 16), (1, 10, 10)]])
def test_the_vision_tower_makes_the_host_wait_nowhere(grids):
    with torch.device("meta"):
        tower = VisionTransformer(LAYOUT)
        pixels = torch.empty(sum(t * h * w for t, h, w in grids), LAYOUT.patch_values)
    with Syncs() as syncs:
        out = tower(pixels, grids)
    assert out.shape == (sum(t * h * w for t, h, w in grids) // 4, LAYOUT.out_hidden_size)
    assert syncs.counts == {}


def test_the_multimodal_rotary_tables_make_the_host_wait_nowhere():
    config = SimpleNamespace(rotary_width=16, max_position_embeddings=64, rope_theta=10000.0, rope_scaling=None)
    positions = torch.randint(0, 64, (3, 10))
    expected = MultimodalRotary(config, (4, 2, 2)).tables(positions)
    # The pairs' rows: the first 4 pairs take the time row, then 2 the height row, 2 the width row.
    rows = [0] * 4 + [1] * 2 + [2] * 2
    table = MultimodalRotary(config, (4, 2, 2)).cos_cache
    assert torch.equal(expected[0], table[positions[rows].T, torch.arange(8)])
    with torch.device("meta"):
        rotary = MultimodalRotary(config, (4, 2, 2))
    with Syncs() as syncs:
        cos, sin = rotary.tables(torch.empty(3, 10, dtype=torch.long, device="meta"))
    assert cos.shape == sin.shape == (10, 8)
    assert syncs.counts == {}
