"""Qwen2.5-VL's vision transformer (transformers' Qwen2_5_VisionTransformerPretrainedModel).

Patches (temporal x spatial, flattened by the image processor) are embedded by a 3-D convolution,
reordered into windows of merged 2x2 patch groups, run through blocks that attend within their
window (or over the whole image: fullatt_block_indexes) with 2-D axial rotary positions, merged
2x2 into the text width, and put back in raster order. Many images run as one ragged batch.

The window order, the segments' rows and the rotary positions depend on the grids alone: they are
computed on the host with numpy once per forward and go to the device in one copy that does not
block, so the host never waits for the device inside the tower.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpuworker.models.qwen2_5_vl.config import VisionLayout

Grid = tuple[int, int, int]  # (t, h, w) in patches


class VisionRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate)
        self.up_proj = nn.Linear(hidden, intermediate)
        self.down_proj = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """segments: per segment length, the rows of the segments of that length [segments, length]
        (Layout.segments); each row attends bidirectionally within its segment."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for rows in segments:  # segments of one length go through one batched call
            qs, ks, vs = (t[rows].transpose(1, 2) for t in (q, k, v))  # [segments, heads, length, dim]
            out[rows] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, layout: VisionLayout) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(layout.hidden_size)
        self.norm2 = VisionRMSNorm(layout.hidden_size)
        self.attn = VisionAttention(layout.hidden_size, layout.num_heads)
        self.mlp = VisionMLP(layout.hidden_size, layout.intermediate_size)

    def forward(
        self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, layout: VisionLayout) -> None:
        super().__init__()
        p, t = layout.patch_size, layout.temporal_patch_size
        self.shape = (layout.in_channels, t, p, p)
        self.proj = nn.Conv3d(layout.in_channels, layout.hidden_size, (t, p, p), stride=(t, p, p), bias=False)
        self.proj.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return self.proj(pixels.view(-1, *self.shape).to(weight.dtype)).view(pixels.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, layout: VisionLayout) -> None:
        super().__init__()
        self.width = layout.hidden_size * layout.spatial_merge_size**2
        self.ln_q = VisionRMSNorm(layout.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, layout.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


@dataclass
class Layout:
    """Where a forward's patches go, on the device: `order` the merge groups window by window,
    `restore` back to raster order, `positions` each patch's (h, w) rotary position in window order
    [N, 2], and per segmentation (`windows`, `frames`: each frame whole) the rows of each length's
    segments (VisionAttention.forward)."""

    order: torch.Tensor
    restore: torch.Tensor
    positions: torch.Tensor
    windows: list[torch.Tensor]
    frames: list[torch.Tensor]


def window_order(grids: list[Grid], merge: int, size: int) -> tuple[np.ndarray, list[int]]:
    """The merge groups reordered window by window (windows of size x size groups), and the
    windows' cumulative patch counts."""
    order, cu, offset = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = size - gh % size, size - gw % size
        nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nh, size, nw, size).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, size, size)
        counts = (padded != -100).sum((2, 3)).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        for c in (counts.cumsum() * merge * merge + cu[-1]).tolist():
            if c != cu[-1]:
                cu.append(c)
        offset += t * gh * gw
    return np.concatenate(order), cu


def rotary_positions(grids: list[Grid], merge: int) -> np.ndarray:
    """Per patch (raster order within merge groups), its (h, w) position [N, 2]."""
    ids = []
    for t, h, w in grids:
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        pos = np.stack(
            [hh.reshape(block).transpose(0, 2, 1, 3).ravel(), ww.reshape(block).transpose(0, 2, 1, 3).ravel()], -1
        )
        ids.append(np.tile(pos, (t, 1)))
    return np.concatenate(ids)


def segment_rows(cu: list[int]) -> list[np.ndarray]:
    """Per segment length (ascending), the rows of the segments of that length [segments, length]."""
    bounds = np.asarray(cu, dtype=np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    return [starts[lengths == length][:, None] + np.arange(length) for length in np.unique(lengths).tolist()]


def to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 host arrays as device tensors of their shapes, in one copy that does not block (from
    pinned memory on CUDA)."""
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(flat.split([a.size for a in arrays]), arrays)]


class VisionTransformer(nn.Module):
    """forward(pixel_values [patches, C*T*P*P], grids) -> [patches / merge**2, text hidden size]."""

    def __init__(self, layout: VisionLayout) -> None:
        super().__init__()
        self.layout = layout
        self.patch_embed = PatchEmbed(layout)
        self.blocks = nn.ModuleList(VisionBlock(layout) for _ in range(layout.depth))
        self.merger = PatchMerger(layout)
        for param in self.parameters():
            param.requires_grad_(False)

    def plan(self, grids: list[Grid], device: torch.device) -> Layout:
        """The forward's Layout for these grids: numpy on the host, one copy to `device`."""
        m = self.layout.spatial_merge_size
        unit = m * m
        order, cu_windows = window_order(grids, m, self.layout.window_size // m // self.layout.patch_size)
        positions = rotary_positions(grids, m)
        positions = positions.reshape(-1, unit, 2)[order].reshape(-1, 2)
        cu_frames = np.cumsum([0] + [h * w for t, h, w in grids for _ in range(t)]).tolist()
        windows, frames = segment_rows(cu_windows), segment_rows(cu_frames)
        parts = to_device([order, np.argsort(order), positions, *windows, *frames], device)
        return Layout(parts[0], parts[1], parts[2], parts[3 : 3 + len(windows)], parts[3 + len(windows) :])

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each patch's (h, w) axial angles (positions [N, 2])."""
        quarter = self.layout.head_dim // 2
        inv_freq = 1.0 / (
            self.layout.rope_theta
            ** (torch.arange(0, quarter, 2, dtype=torch.float, device=positions.device) / quarter)
        )
        freqs = positions[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        unit = self.layout.spatial_merge_size**2
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        layout = self.plan(grids, x.device)
        x = x.reshape(n // unit, unit, -1)[layout.order].reshape(n, -1)
        cos, sin = self.rotary(layout.positions)
        full = set(self.layout.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, layout.frames if i in full else layout.windows, cos, sin)
        return self.merger(x)[layout.restore]
