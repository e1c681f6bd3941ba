"""Qwen2.5-VL's vision transformer (transformers' Qwen2_5_VisionTransformerPretrainedModel).

Patches (temporal x spatial, flattened by the image processor) are embedded by a 3-D convolution,
reordered into windows of merged 2x2 patch groups, run through blocks that attend within their
window (or over the whole image: fullatt_block_indexes) with 2-D axial rotary positions, merged
2x2 into the text width, and put back in raster order. Many images run as one ragged batch.
"""

from __future__ import annotations

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

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        # Bidirectional within each segment; segments of one length go through one batched call.
        starts = torch.tensor(cu_seqlens[:-1])
        lengths = torch.tensor(cu_seqlens[1:]) - starts
        for length in lengths.unique().tolist():
            rows = (starts[lengths == length][:, None] + torch.arange(length)[None, :]).to(x.device)
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

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
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

    def rotary(self, grids: list[Grid], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch (raster order within merge groups), cos and sin of its (h, w) axial angles."""
        m = self.layout.spatial_merge_size
        ids = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            block = (h // m, m, w // m, m)
            pos = torch.stack(
                [hh.reshape(block).transpose(1, 2).flatten(), ww.reshape(block).transpose(1, 2).flatten()], -1
            )
            ids.append(pos.repeat(t, 1))
        positions = torch.cat(ids).to(device)
        quarter = self.layout.head_dim // 2
        inv_freq = 1.0 / (
            self.layout.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=device) / quarter)
        )
        freqs = positions[..., None].float() * inv_freq  # [N, 2, head_dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def windows(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """The merge groups reordered window by window, and the windows' cumulative patch counts."""
        m = self.layout.spatial_merge_size
        size = self.layout.window_size // m // self.layout.patch_size
        order, cu, offset = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            pad_h, pad_w = size - gh % size, size - gw % size
            nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
            padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
            padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size, size)
            counts = (padded != -100).sum([2, 3]).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat != -100] + offset)
            for c in (counts.cumsum(0) * m * m + cu[-1]).tolist():
                if c != cu[-1]:
                    cu.append(c)
            offset += t * gh * gw
        return torch.cat(order), cu

    def forward(self, pixel_values: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        unit = self.layout.spatial_merge_size**2
        x = self.patch_embed(pixel_values)
        n = x.shape[0]
        order, cu_windows = self.windows(grids)
        order = order.to(x.device)
        cu_full = [0]
        for t, h, w in grids:
            for _ in range(t):  # each frame attends within itself
                cu_full.append(cu_full[-1] + h * w)
        x = x.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        cos, sin = self.rotary(grids, x.device)
        cos = cos.reshape(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
        sin = sin.reshape(n // unit, unit, 1, -1)[order].reshape(n, 1, -1)
        full = set(self.layout.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_full if i in full else cu_windows, cos, sin)
        return self.merger(x)[torch.argsort(order)]
