"""Qwen-VL vision-tower attention in one call per layer, not one per window.

mlx-vlm's Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers keep attention within segments of the patch sequence: each
image (and, in Qwen2.5-VL's windowed layers, each 8x8-patch window). Their ``Attention`` reads the segment
bounds back from the device (``cu_seqlens.tolist()``, once a layer) and runs one attention call per segment: a
448-px image is 16 windows, so four such images cost a Qwen2.5-VL-7B tower about 1,800 attention calls and 32 waits
for the device, and the tower is bound by the host (``docs/benchmarks/vision.md``).

:class:`SegmentAttention` holds the same ``qkv`` and ``proj`` layers and computes the same thing with one call a
layer: the segments become the rows of one batch, of their common length or padded to the longest with the padding
masked out of the keys. The bounds are read once per bounds array (the tower passes the same array object to every
layer of a kind), so a tower call waits for the device twice, not once a layer. :func:`use_segment_attention` swaps
the modules in through MLX's public ``update_modules``; the mlx-vlm classes are untouched.

On GPU backends the batch goes to MLX's fused attention (through mlx-vlm's ``ensure_fused_sdpa``); on the CPU, whose
tower is bound by the softmax's arithmetic, not the host, to :func:`mlxd.models.cpu_attention.cpu_attention`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm.models.base import ensure_fused_sdpa

from mlxd.models.cpu_attention import cpu_attention

# Families whose vision module has this ``Attention(x, cu_seqlens, rotary_pos_emb)`` (mlx-vlm 0.7.10).
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Where the segments of an N-patch sequence lie, as one (S, L) batch: ``length`` when every segment has it
    (a reshape), else ``gather`` (S, L) positions padded to the longest, ``keys`` (S, 1, 1, L) marking real ones
    and ``scatter`` each patch's place in the flattened batch."""

    num_segments: int
    length: int
    gather: mx.array | None = None
    keys: mx.array | None = None
    scatter: mx.array | None = None

    @classmethod
    def of(cls, bounds: list[int]) -> SegmentLayout:
        """The layout of segments ``[bounds[i], bounds[i + 1])`` (empty ones dropped)."""
        starts, ends = np.array(bounds[:-1]), np.array(bounds[1:])
        keep = ends > starts
        starts, lengths = starts[keep], (ends - starts)[keep]
        longest = int(lengths.max())
        if (lengths == longest).all():
            return cls(len(lengths), longest)
        offsets = np.arange(longest)
        real = offsets[None, :] < lengths[:, None]
        gather = np.where(real, starts[:, None] + offsets[None, :], 0)
        scatter = np.flatnonzero(real)  # row-major: segment by segment, each in order, as the patches lie
        return cls(len(lengths), longest, mx.array(gather.astype(np.int32)), mx.array(real[:, None, None, :]),
                   mx.array(scatter.astype(np.int32)))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Attention within each segment of ``q``, ``k``, ``v`` (N, H, D); returns (N, H * D)."""
        n, heads, dim = q.shape
        if self.gather is None:
            q, k, v = (t.reshape(self.num_segments, self.length, heads, dim).transpose(0, 2, 1, 3)
                       for t in (q, k, v))
            out = _attention(q, k, v, scale)
            return out.transpose(0, 2, 1, 3).reshape(n, heads * dim)
        q, k, v = (t[self.gather].transpose(0, 2, 1, 3) for t in (q, k, v))
        out = _attention(q, k, v, scale, mask=self.keys)
        return out.transpose(0, 2, 1, 3).reshape(-1, heads * dim)[self.scatter]


def _attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    if mx.default_device() == mx.cpu:
        return cpu_attention(q, k, v, scale, mask)
    return ensure_fused_sdpa(q, k, v, scale, mask=mask)


class LayoutMemo:
    """The layouts of the last few bounds arrays, by identity: every layer of a tower call gets the same array
    object for its kind of attention, so its bounds are read from the device once per call and kind. The arrays
    are held (strong references), so an identity is never reused while remembered."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[mx.array, SegmentLayout]] = []

    def layout(self, cu_seqlens: mx.array) -> SegmentLayout:
        for array, layout in self._entries:
            if array is cu_seqlens:
                return layout
        layout = SegmentLayout.of(cu_seqlens.tolist())
        self._entries = [(cu_seqlens, layout), *self._entries[: self.size - 1]]
        return layout


class SegmentAttention(nn.Module):
    """A family ``Attention``'s layers and arithmetic, with its per-segment loop replaced by one batched call."""

    def __init__(self, attention: nn.Module, rotary: Any, memo: LayoutMemo) -> None:
        super().__init__()
        self.qkv = attention.qkv
        self.proj = attention.proj
        # Plain attributes (not module state).
        object.__setattr__(self, "num_heads", attention.num_heads)
        object.__setattr__(self, "scale", attention.scale)
        object.__setattr__(self, "_rotary", rotary)
        object.__setattr__(self, "_memo", memo)

    def __call__(self, x: mx.array, cu_seqlens: mx.array, rotary_pos_emb: mx.array | None = None) -> mx.array:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).transpose(1, 0, 2, 3)
        q = self._rotary(q[None, None], rotary_pos_emb)[0, 0]
        k = self._rotary(k[None, None], rotary_pos_emb)[0, 0]
        return self.proj(self._memo.layout(cu_seqlens).attend(q, k, v, self.scale))


def use_segment_attention(vlm: Any, family: str) -> int:
    """Swap the vision tower's attention modules of a :data:`FAMILIES` model for :class:`SegmentAttention`;
    returns how many (0 for other families)."""
    if family not in FAMILIES:
        return 0
    vision = importlib.import_module(f"mlx_vlm.models.{family}.vision")
    memo, swapped = LayoutMemo(), 0
    for block in vlm.vision_tower.blocks:
        if type(block.attn) is vision.Attention:
            block.update_modules({"attn": SegmentAttention(block.attn, vision.apply_rotary_pos_emb_vision, memo)})
            swapped += 1
    return swapped
